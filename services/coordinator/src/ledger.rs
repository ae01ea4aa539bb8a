//! The work ledger: every batch of the run and where it is, in SQLite on
//! disk so that it survives coordinator restarts.
//!
//! A batch moves pending -> leased (a target computes it) -> sent (the
//! drafter acknowledged it) -> trained (an optimizer step used it) ->
//! committed (a checkpoint holds that step). Failures move it back:
//! an expired lease or a dead target returns leased batches to pending; a
//! drafter that restarts from its last checkpoint returns sent and trained
//! batches that the checkpoint does not hold to pending.

use std::collections::BTreeMap;
use std::path::Path;

use dflash_data::PlannedBatch;
use rusqlite::{Connection, OptionalExtension, params};

/// Why the ledger could not be used.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("ledger {path}: {source}")]
    Sqlite { path: String, source: rusqlite::Error },
    #[error("ledger {path} belongs to another plan ({what}); use another --ledger file or the original config")]
    PlanMismatch { path: String, what: String },
}

/// Counts of batches per state.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub pending: u64,
    pub leased: u64,
    pub sent: u64,
    pub trained: u64,
    pub committed: u64,
}

impl Counts {
    pub fn total(&self) -> u64 {
        self.pending + self.leased + self.sent + self.trained + self.committed
    }
}

/// A batch handed to a target.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    pub batch_id: u64,
    pub epoch: u32,
    pub sample_ids: Vec<u64>,
    pub sample_lengths: Vec<u32>,
    pub expires_ms: u64,
}

/// Per-batch counters, for tests and audits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchAudit {
    pub batch_id: u64,
    pub state: String,
    pub leases: u64,
    pub trains: u64,
    pub commits: u64,
}

pub struct Ledger {
    conn: Connection,
    path: String,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
  batch_id INTEGER PRIMARY KEY,
  epoch INTEGER NOT NULL,
  sample_ids TEXT NOT NULL,
  sample_lengths TEXT NOT NULL,
  state TEXT NOT NULL CHECK (state IN ('pending', 'leased', 'sent', 'trained', 'committed')),
  holder TEXT,
  lease_expires_ms INTEGER,
  trained_step INTEGER,
  leases INTEGER NOT NULL DEFAULT 0,
  trains INTEGER NOT NULL DEFAULT 0,
  commits INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS batches_by_state ON batches (state, batch_id);
";

fn join<T: ToString>(v: &[T]) -> String {
    v.iter().map(ToString::to_string).collect::<Vec<_>>().join(",")
}

fn split<T: std::str::FromStr>(s: &str) -> Vec<T> {
    s.split(',').filter(|x| !x.is_empty()).filter_map(|x| x.parse().ok()).collect()
}

impl Ledger {
    /// Opens (or creates) the ledger at `path`.
    pub fn open(path: &Path) -> Result<Self, LedgerError> {
        let p = path.display().to_string();
        let wrap = |source| LedgerError::Sqlite { path: p.clone(), source };
        if let Some(dir) = path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let conn = Connection::open(path).map_err(wrap)?;
        conn.execute_batch("PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL;").map_err(wrap)?;
        conn.execute_batch(SCHEMA).map_err(wrap)?;
        Ok(Self { conn, path: p })
    }

    fn err(&self, source: rusqlite::Error) -> LedgerError {
        LedgerError::Sqlite { path: self.path.clone(), source }
    }

    pub fn meta(&self, key: &str) -> Result<Option<String>, LedgerError> {
        self.conn
            .query_row("SELECT value FROM meta WHERE key = ?1", [key], |r| r.get(0))
            .optional()
            .map_err(|e| self.err(e))
    }

    pub fn set_meta(&self, key: &str, value: &str) -> Result<(), LedgerError> {
        self.conn
            .execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?1, ?2)", params![key, value])
            .map(|_| ())
            .map_err(|e| self.err(e))
    }

    /// Writes the plan on first use; on later opens checks that the plan
    /// is the same (fingerprint) and keeps the recorded progress.
    /// Returns true when the ledger already held this plan (a resume).
    pub fn install_plan(&mut self, fingerprint: &str, plan: &[PlannedBatch]) -> Result<bool, LedgerError> {
        if let Some(existing) = self.meta("plan_fingerprint")? {
            if existing != fingerprint {
                return Err(LedgerError::PlanMismatch {
                    path: self.path.clone(),
                    what: format!("recorded {existing}, configured {fingerprint}"),
                });
            }
            return Ok(true);
        }
        let tx = self.conn.transaction().map_err(|e| LedgerError::Sqlite { path: self.path.clone(), source: e })?;
        {
            let mut ins = tx
                .prepare(
                    "INSERT INTO batches (batch_id, epoch, sample_ids, sample_lengths, state) \
                     VALUES (?1, ?2, ?3, ?4, 'pending')",
                )
                .map_err(|e| LedgerError::Sqlite { path: self.path.clone(), source: e })?;
            for b in plan {
                ins.execute(params![b.batch_id as i64, b.epoch, join(&b.sample_ids), join(&b.sample_lengths)])
                    .map_err(|e| LedgerError::Sqlite { path: self.path.clone(), source: e })?;
            }
            tx.execute("INSERT INTO meta (key, value) VALUES ('plan_fingerprint', ?1)", [fingerprint])
                .map_err(|e| LedgerError::Sqlite { path: self.path.clone(), source: e })?;
        }
        tx.commit().map_err(|e| LedgerError::Sqlite { path: self.path.clone(), source: e })?;
        Ok(false)
    }

    /// Leases up to `n` pending batches (lowest ids first) to `holder`.
    pub fn lease(&mut self, holder: &str, n: u32, now_ms: u64, lease_ms: u64) -> Result<Vec<Lease>, LedgerError> {
        let expires = now_ms + lease_ms;
        let path = self.path.clone();
        let wrap = |source| LedgerError::Sqlite { path: path.clone(), source };
        let tx = self.conn.transaction().map_err(wrap)?;
        let rows: Vec<(i64, u32, String, String)> = {
            let mut q = tx
                .prepare("SELECT batch_id, epoch, sample_ids, sample_lengths FROM batches WHERE state = 'pending' ORDER BY batch_id LIMIT ?1")
                .map_err(wrap)?;
            q.query_map([n], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
                .map_err(wrap)?
                .collect::<Result<_, _>>()
                .map_err(wrap)?
        };
        for (id, ..) in &rows {
            tx.execute(
                "UPDATE batches SET state = 'leased', holder = ?2, lease_expires_ms = ?3, leases = leases + 1 WHERE batch_id = ?1",
                params![id, holder, expires as i64],
            )
            .map_err(wrap)?;
        }
        tx.commit().map_err(wrap)?;
        Ok(rows
            .into_iter()
            .map(|(id, epoch, ids, lens)| Lease {
                batch_id: id as u64,
                epoch,
                sample_ids: split(&ids),
                sample_lengths: split(&lens),
                expires_ms: expires,
            })
            .collect())
    }

    /// Extends the leases `holder` still holds.
    pub fn renew(&mut self, holder: &str, batch_ids: &[u64], now_ms: u64, lease_ms: u64) -> Result<(), LedgerError> {
        let path = self.path.clone();
        let wrap = |source| LedgerError::Sqlite { path: path.clone(), source };
        let tx = self.conn.transaction().map_err(wrap)?;
        for id in batch_ids {
            tx.execute(
                "UPDATE batches SET lease_expires_ms = ?3 WHERE batch_id = ?1 AND state = 'leased' AND holder = ?2",
                params![*id as i64, holder, (now_ms + lease_ms) as i64],
            )
            .map_err(wrap)?;
        }
        tx.commit().map_err(wrap)
    }

    /// Batches the drafter acknowledged to `holder`.
    pub fn mark_sent(&mut self, holder: &str, batch_ids: &[u64]) -> Result<(), LedgerError> {
        self.update_each(
            batch_ids,
            "UPDATE batches SET state = 'sent', lease_expires_ms = NULL WHERE batch_id = ?1 AND state = 'leased' AND holder = ?2",
            Some(holder),
        )
    }

    /// Batches an optimizer step used (or skipped as bad data).
    pub fn mark_trained(&mut self, batch_ids: &[u64], step: u64) -> Result<(), LedgerError> {
        let path = self.path.clone();
        let wrap = |source| LedgerError::Sqlite { path: path.clone(), source };
        let tx = self.conn.transaction().map_err(wrap)?;
        for id in batch_ids {
            // A replayed batch may be trained before its target's ReportSent
            // arrives, so leased batches count too.
            tx.execute(
                "UPDATE batches SET state = 'trained', trained_step = ?2, trains = trains + 1, holder = NULL, \
                 lease_expires_ms = NULL WHERE batch_id = ?1 AND state IN ('leased', 'sent')",
                params![*id as i64, step as i64],
            )
            .map_err(wrap)?;
        }
        tx.commit().map_err(wrap)
    }

    /// A checkpoint holds these batches: commit them (idempotent).
    pub fn mark_committed(&mut self, batch_ids: &[u64]) -> Result<(), LedgerError> {
        self.update_each(
            batch_ids,
            "UPDATE batches SET state = 'committed', commits = commits + 1, holder = NULL, lease_expires_ms = NULL \
             WHERE batch_id = ?1 AND state != 'committed'",
            None,
        )
    }

    /// The drafter restarted from a checkpoint: sent and trained batches not
    /// in it go back to pending to be computed again. Returns how many.
    pub fn reset_uncommitted(&mut self) -> Result<u64, LedgerError> {
        self.conn
            .execute(
                "UPDATE batches SET state = 'pending', holder = NULL, lease_expires_ms = NULL, trained_step = NULL \
                 WHERE state IN ('sent', 'trained')",
                [],
            )
            .map(|n| n as u64)
            .map_err(|e| self.err(e))
    }

    /// Leases of a dead target go back to pending. Returns how many.
    pub fn release_holder(&mut self, holder: &str) -> Result<u64, LedgerError> {
        self.conn
            .execute(
                "UPDATE batches SET state = 'pending', holder = NULL, lease_expires_ms = NULL \
                 WHERE state = 'leased' AND holder = ?1",
                [holder],
            )
            .map(|n| n as u64)
            .map_err(|e| self.err(e))
    }

    /// Expired leases go back to pending. Returns how many.
    pub fn expire_leases(&mut self, now_ms: u64) -> Result<u64, LedgerError> {
        self.conn
            .execute(
                "UPDATE batches SET state = 'pending', holder = NULL, lease_expires_ms = NULL \
                 WHERE state = 'leased' AND lease_expires_ms < ?1",
                [now_ms as i64],
            )
            .map(|n| n as u64)
            .map_err(|e| self.err(e))
    }

    pub fn counts(&self) -> Result<Counts, LedgerError> {
        let mut q = self.conn.prepare("SELECT state, COUNT(*) FROM batches GROUP BY state").map_err(|e| self.err(e))?;
        let rows: BTreeMap<String, u64> = q
            .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)? as u64)))
            .map_err(|e| self.err(e))?
            .collect::<Result<_, _>>()
            .map_err(|e| self.err(e))?;
        let get = |k: &str| rows.get(k).copied().unwrap_or(0);
        Ok(Counts {
            pending: get("pending"),
            leased: get("leased"),
            sent: get("sent"),
            trained: get("trained"),
            committed: get("committed"),
        })
    }

    /// Every batch's counters, by id.
    pub fn audit(&self) -> Result<Vec<BatchAudit>, LedgerError> {
        let mut q = self
            .conn
            .prepare("SELECT batch_id, state, leases, trains, commits FROM batches ORDER BY batch_id")
            .map_err(|e| self.err(e))?;
        q.query_map([], |r| {
            Ok(BatchAudit {
                batch_id: r.get::<_, i64>(0)? as u64,
                state: r.get(1)?,
                leases: r.get::<_, i64>(2)? as u64,
                trains: r.get::<_, i64>(3)? as u64,
                commits: r.get::<_, i64>(4)? as u64,
            })
        })
        .map_err(|e| self.err(e))?
        .collect::<Result<_, _>>()
        .map_err(|e| self.err(e))
    }

    /// Runs `sql` once per batch id (`?1`), with `holder` as `?2` if given.
    fn update_each(&mut self, batch_ids: &[u64], sql: &str, holder: Option<&str>) -> Result<(), LedgerError> {
        let path = self.path.clone();
        let wrap = |source| LedgerError::Sqlite { path: path.clone(), source };
        let tx = self.conn.transaction().map_err(wrap)?;
        {
            let mut st = tx.prepare(sql).map_err(wrap)?;
            for id in batch_ids {
                match holder {
                    Some(h) => st.execute(params![*id as i64, h]),
                    None => st.execute(params![*id as i64]),
                }
                .map_err(wrap)?;
            }
        }
        tx.commit().map_err(wrap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(n: u64) -> Vec<PlannedBatch> {
        (0..n)
            .map(|i| PlannedBatch {
                batch_id: i,
                epoch: 0,
                sample_ids: vec![i * 2, i * 2 + 1],
                sample_lengths: vec![5, 6],
            })
            .collect()
    }

    #[test]
    fn batches_move_through_every_state_and_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l.sqlite");
        let mut l = Ledger::open(&path).unwrap();
        assert!(!l.install_plan("fp", &plan(4)).unwrap());
        let leases = l.lease("t0", 3, 1000, 50).unwrap();
        assert_eq!(leases.iter().map(|l| l.batch_id).collect::<Vec<_>>(), vec![0, 1, 2]);
        assert_eq!(leases[1].sample_ids, vec![2, 3]);
        l.mark_sent("t0", &[0, 1]).unwrap();
        l.mark_trained(&[0], 1).unwrap();
        l.mark_committed(&[0]).unwrap();
        assert_eq!(l.counts().unwrap(), Counts { pending: 1, leased: 1, sent: 1, trained: 0, committed: 1 });
        drop(l);

        let mut l = Ledger::open(&path).unwrap();
        assert!(l.install_plan("fp", &plan(4)).unwrap(), "reopen resumes");
        assert!(matches!(l.install_plan("other", &plan(4)), Err(LedgerError::PlanMismatch { .. })));
        assert_eq!(l.counts().unwrap().committed, 1);
    }

    #[test]
    fn failures_return_work_to_pending() {
        let dir = tempfile::tempdir().unwrap();
        let mut l = Ledger::open(&dir.path().join("l.sqlite")).unwrap();
        l.install_plan("fp", &plan(6)).unwrap();
        l.lease("t0", 2, 1000, 50).unwrap(); // 0, 1 expire at 1050
        l.lease("t1", 2, 1000, 500).unwrap(); // 2, 3
        l.renew("t0", &[0], 1040, 50).unwrap(); // 0 now expires at 1090
        assert_eq!(l.expire_leases(1060).unwrap(), 1, "batch 1 expired");
        assert_eq!(l.release_holder("t1").unwrap(), 2, "dead target's leases");
        l.mark_sent("t0", &[0]).unwrap();
        l.mark_trained(&[0], 1).unwrap();
        assert_eq!(l.reset_uncommitted().unwrap(), 1, "drafter restart");
        assert_eq!(l.counts().unwrap().pending, 6);
        let again = l.lease("t2", 10, 2000, 50).unwrap();
        assert_eq!(again.len(), 6);
        assert_eq!(l.audit().unwrap()[0].leases, 2);
    }

    #[test]
    fn commits_are_idempotent() {
        let dir = tempfile::tempdir().unwrap();
        let mut l = Ledger::open(&dir.path().join("l.sqlite")).unwrap();
        l.install_plan("fp", &plan(2)).unwrap();
        l.lease("t0", 2, 0, 50).unwrap();
        l.mark_trained(&[0, 1], 1).unwrap();
        l.mark_committed(&[0, 1]).unwrap();
        l.mark_committed(&[0, 1]).unwrap();
        assert!(l.audit().unwrap().iter().all(|a| a.commits == 1 && a.trains == 1));
    }
}
