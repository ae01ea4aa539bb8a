//! The work ledger: every batch of the run and where it is, in SQLite on
//! disk so that it survives coordinator restarts.
//!
//! A batch moves pending -> leased (a target computes it) -> sent (the
//! drafter acknowledged it) -> trained (an optimizer step used it) ->
//! committed (a checkpoint holds that step). Failures move it back:
//! an expired lease or a dead target returns leased batches to pending; a
//! drafter that restarts from a checkpoint returns sent and trained
//! batches that the checkpoint does not hold to pending, and, when it had
//! to fall back to an older committed checkpoint, the batches committed
//! after that one too.
//!
//! Every committed checkpoint is recorded (step, directory name, content
//! hash): a drafter resumes from what the ledger says was committed, never
//! silently from nothing. Transitions are legal only from the state a
//! batch is in and, for commits, only from the drafter that trained it.

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
    /// A report asks for a transition the ledger does not allow.
    #[error("{0}")]
    Refused(String),
}

/// A committed checkpoint, as the ledger records it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointRecord {
    pub step: u64,
    pub name: String,
    pub content_hash: String,
}

/// What a drafter's starting checkpoint did to the ledger.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Resumed {
    /// Sent or trained batches the checkpoint does not hold: pending again.
    pub redo: u64,
    /// Batches committed after the checkpoint (a fall-back): pending again.
    pub uncommitted: u64,
    /// Batches the checkpoint holds that the ledger had not committed yet
    /// (its report was lost): committed now.
    pub newly_committed: u64,
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
    /// The drafter group member that trained it last.
    pub member: Option<String>,
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
  commits INTEGER NOT NULL DEFAULT 0,
  trained_by TEXT,
  committed_step INTEGER,
  -- the drafter group member that trained (or skipped) the batch
  trained_member TEXT
);
CREATE INDEX IF NOT EXISTS batches_by_state ON batches (state, batch_id);
-- How many batches are in each state, kept by the triggers below in the
-- transaction that changes a state: counting them by a scan took 12 ms at
-- 200,000 batches, and the coordinator counts at every lease request.
CREATE TABLE IF NOT EXISTS state_counts (state TEXT PRIMARY KEY, n INTEGER NOT NULL);
CREATE TRIGGER IF NOT EXISTS batches_count_insert AFTER INSERT ON batches BEGIN
  INSERT INTO state_counts (state, n) VALUES (NEW.state, 1) ON CONFLICT (state) DO UPDATE SET n = n + 1;
END;
CREATE TRIGGER IF NOT EXISTS batches_count_delete AFTER DELETE ON batches BEGIN
  UPDATE state_counts SET n = n - 1 WHERE state = OLD.state;
END;
CREATE TRIGGER IF NOT EXISTS batches_count_update AFTER UPDATE OF state ON batches
  WHEN OLD.state != NEW.state BEGIN
  UPDATE state_counts SET n = n - 1 WHERE state = OLD.state;
  INSERT INTO state_counts (state, n) VALUES (NEW.state, 1) ON CONFLICT (state) DO UPDATE SET n = n + 1;
END;
CREATE TABLE IF NOT EXISTS progress (
  step INTEGER PRIMARY KEY,
  loss REAL NOT NULL,
  accuracy REAL NOT NULL,
  acceptance_length REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS checkpoints (
  step INTEGER PRIMARY KEY,
  name TEXT NOT NULL,
  content_hash TEXT NOT NULL,
  committed_ms INTEGER NOT NULL
);
";

/// One step's training figures, as the drafter reported them.
pub use dflash_proto::ProgressPoint;

/// Columns added after the first release, for ledgers written before them.
const ADDED_COLUMNS: &[(&str, &str)] =
    &[("trained_by", "TEXT"), ("committed_step", "INTEGER"), ("trained_member", "TEXT")];

fn join<T: ToString>(v: &[T]) -> String {
    v.iter().map(ToString::to_string).collect::<Vec<_>>().join(",")
}

/// The first hex digits of a hash, for messages.
fn short(hash: &str) -> &str {
    &hash[..hash.len().min(12)]
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
        let columns: Vec<String> = conn
            .prepare("SELECT name FROM pragma_table_info('batches')")
            .and_then(|mut q| q.query_map([], |r| r.get(0))?.collect())
            .map_err(wrap)?;
        for (name, kind) in ADDED_COLUMNS {
            if !columns.iter().any(|c| c == name) {
                conn.execute_batch(&format!("ALTER TABLE batches ADD COLUMN {name} {kind}")).map_err(wrap)?;
            }
        }
        // Counted once from the batches themselves (one scan per start), so
        // that a ledger written before the counts were kept, or by hand,
        // starts from the truth; the triggers keep them from here on.
        conn.execute_batch(
            "BEGIN; DELETE FROM state_counts; \
             INSERT INTO state_counts (state, n) SELECT state, COUNT(*) FROM batches GROUP BY state; COMMIT;",
        )
        .map_err(wrap)?;
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

    /// The run's lease key ([`dflash_proto::lease_token`]): made once, on
    /// the first start, and kept here, so a restarted coordinator issues
    /// the tokens its drafters already check.
    pub fn lease_key(&self) -> Result<Vec<u8>, LedgerError> {
        if let Some(hex) = self.meta("lease_key")?
            && let Some(key) = from_hex(&hex)
        {
            return Ok(key);
        }
        let key: Vec<u8> = (0..dflash_proto::lease_token::KEY_BYTES).map(|_| rand::random::<u8>()).collect();
        self.set_meta("lease_key", &key.iter().map(|b| format!("{b:02x}")).collect::<String>())?;
        Ok(key)
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
    /// With a `window` (> 0), only batches less than `window` ids past the
    /// first one not yet trained: the drafter trains in id order and holds
    /// at most that many that arrive early.
    pub fn lease(
        &mut self,
        holder: &str,
        n: u32,
        now_ms: u64,
        lease_ms: u64,
        window: u64,
    ) -> Result<Vec<Lease>, LedgerError> {
        let expires = now_ms + lease_ms;
        let path = self.path.clone();
        let wrap = |source| LedgerError::Sqlite { path: path.clone(), source };
        let tx = self.conn.transaction().map_err(wrap)?;
        let rows: Vec<(i64, u32, String, String)> = {
            let mut q = tx
                // The window counts plan positions from the first batch not
                // trained yet, not batch ids: ids jump at every epoch
                // (epoch << 32 | index), and a window of ids would lease
                // nothing of the next epoch while the last batch of this one
                // waits (a drafter group whose member holds it waits for its
                // partner's batch from the next epoch: the run stalled).
                .prepare(
                    "SELECT batch_id, epoch, sample_ids, sample_lengths FROM batches WHERE state = 'pending' \
                     AND (?2 = 0 OR batch_id IN (SELECT batch_id FROM batches WHERE batch_id >= \
                     (SELECT MIN(batch_id) FROM batches WHERE state IN ('pending', 'leased', 'sent')) \
                     ORDER BY batch_id LIMIT ?2)) ORDER BY batch_id LIMIT ?1",
                )
                .map_err(wrap)?;
            q.query_map(params![n, window as i64], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
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
    /// Batches `holder` leased that the drafter acknowledged; each must be
    /// trained by `train_by_ms` or it goes back to pending
    /// ([`Ledger::expire_sent`]).
    pub fn mark_sent(&mut self, holder: &str, batch_ids: &[u64], train_by_ms: u64) -> Result<(), LedgerError> {
        let path = self.path.clone();
        let wrap = |source| LedgerError::Sqlite { path: path.clone(), source };
        let tx = self.conn.transaction().map_err(wrap)?;
        for id in batch_ids {
            tx.execute(
                "UPDATE batches SET state = 'sent', lease_expires_ms = ?3 WHERE batch_id = ?1 AND state = 'leased' \
                 AND holder = ?2",
                params![*id as i64, holder, train_by_ms.min(i64::MAX as u64) as i64],
            )
            .map_err(wrap)?;
        }
        tx.commit().map_err(wrap)
    }

    /// Batches an optimizer step of drafter `by` used (or skipped as bad data).
    pub fn mark_trained(&mut self, by: &str, batch_ids: &[u64], step: u64) -> Result<(), LedgerError> {
        let path = self.path.clone();
        let wrap = |source| LedgerError::Sqlite { path: path.clone(), source };
        let tx = self.conn.transaction().map_err(wrap)?;
        for id in batch_ids {
            // The drafter's word is what counts: a replayed batch may be
            // trained before its target's ReportSent arrives (leased), and a
            // target may be presumed dead after sending a batch but before
            // reporting it (its leases went back to pending).
            tx.execute(
                "UPDATE batches SET state = 'trained', trained_step = ?2, trains = trains + 1, holder = NULL, \
                 lease_expires_ms = NULL, trained_by = ?3 WHERE batch_id = ?1 AND state IN ('pending', 'leased', 'sent')",
                params![*id as i64, step as i64, by],
            )
            .map_err(wrap)?;
        }
        tx.commit().map_err(wrap)
    }

    /// Drafter `by` wrote checkpoint `record` holding `batch_ids`: commits
    /// them and records the checkpoint. Every id must be trained by `by`
    /// or already committed; otherwise nothing changes and the report is
    /// refused (naming the first offenders). Idempotent.
    pub fn commit_checkpoint(
        &mut self,
        by: &str,
        record: &CheckpointRecord,
        batch_ids: &[u64],
    ) -> Result<u64, LedgerError> {
        let path = self.path.clone();
        let wrap = |source| LedgerError::Sqlite { path: path.clone(), source };
        let tx = self.conn.transaction().map_err(wrap)?;
        let mut illegal = Vec::new();
        let mut fresh = 0;
        {
            let mut q = tx.prepare("SELECT state, trained_by FROM batches WHERE batch_id = ?1").map_err(wrap)?;
            let mut commit = tx
                .prepare(
                    "UPDATE batches SET state = 'committed', commits = commits + 1, holder = NULL, \
                     lease_expires_ms = NULL, committed_step = ?2 WHERE batch_id = ?1",
                )
                .map_err(wrap)?;
            for &id in batch_ids {
                let row: Option<(String, Option<String>)> =
                    q.query_row([id as i64], |r| Ok((r.get(0)?, r.get(1)?))).optional().map_err(wrap)?;
                match row {
                    Some((state, _)) if state == "committed" => {}
                    Some((state, who)) if state == "trained" && who.as_deref() == Some(by) => {
                        commit.execute(params![id as i64, record.step as i64]).map_err(wrap)?;
                        fresh += 1;
                    }
                    Some((state, who)) => {
                        illegal.push(format!("{id} ({state}{})", who.map(|w| format!(" by {w}")).unwrap_or_default()))
                    }
                    None => illegal.push(format!("{id} (not in the plan)")),
                }
            }
        }
        if !illegal.is_empty() {
            return Err(LedgerError::Refused(format!(
                "checkpoint {} of {by} holds {} batch(es) that it has not trained (first: {}); nothing was committed",
                record.name,
                illegal.len(),
                illegal.iter().take(5).cloned().collect::<Vec<_>>().join(", ")
            )));
        }
        tx.execute(
            "INSERT OR REPLACE INTO checkpoints (step, name, content_hash, committed_ms) VALUES (?1, ?2, ?3, ?4)",
            params![record.step as i64, record.name, record.content_hash, crate::clock::now_ms() as i64],
        )
        .map_err(wrap)?;
        tx.commit().map_err(wrap)?;
        Ok(fresh)
    }

    /// The committed checkpoints, newest first.
    pub fn checkpoints(&self) -> Result<Vec<CheckpointRecord>, LedgerError> {
        let mut q = self
            .conn
            .prepare("SELECT step, name, content_hash FROM checkpoints ORDER BY step DESC")
            .map_err(|e| self.err(e))?;
        q.query_map([], |r| {
            Ok(CheckpointRecord { step: r.get::<_, i64>(0)? as u64, name: r.get(1)?, content_hash: r.get(2)? })
        })
        .map_err(|e| self.err(e))?
        .collect::<Result<_, _>>()
        .map_err(|e| self.err(e))
    }

    /// A drafter starts from `start` (None: from nothing) holding
    /// `batch_ids`. Allowed when the start is a checkpoint the ledger
    /// committed (a later one is a fall-back: what those committed goes
    /// back to pending), or a newer one whose report was lost and that
    /// holds everything committed plus batches still trained or in
    /// flight. Starting from nothing is refused once anything is
    /// committed: that would silently throw trained work away.
    pub fn resume(
        &mut self,
        by: &str,
        start: Option<&CheckpointRecord>,
        batch_ids: &[u64],
    ) -> Result<Resumed, LedgerError> {
        let committed = self.checkpoints()?;
        let newest = committed.first().cloned();
        let mut out = Resumed::default();
        match (start, &newest) {
            (None, Some(n)) => {
                return Err(LedgerError::Refused(format!(
                    "the ledger has committed checkpoints up to step {} ({}, content {}); a drafter without a \
                     checkpoint would start from random weights and lose them. Make that checkpoint reachable \
                     in checkpoint.dir (a mounted volume?) or start a new run",
                    n.step,
                    n.name,
                    short(&n.content_hash)
                )));
            }
            (None, None) => {}
            (Some(s), _) if committed.iter().any(|c| c == s) => {
                out.uncommitted = self.uncommit_after(s.step)?;
            }
            (Some(s), n) if n.as_ref().is_none_or(|n| s.step > n.step) => {
                let path = self.path.clone();
                let wrap = |source| LedgerError::Sqlite { path: path.clone(), source };
                let held: std::collections::BTreeSet<u64> = batch_ids.iter().copied().collect();
                let missing: Vec<u64> = {
                    let mut q =
                        self.conn.prepare("SELECT batch_id FROM batches WHERE state = 'committed'").map_err(wrap)?;
                    q.query_map([], |r| r.get::<_, i64>(0))
                        .map_err(wrap)?
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(wrap)?
                        .into_iter()
                        .map(|i| i as u64)
                        .filter(|i| !held.contains(i))
                        .collect()
                };
                if !missing.is_empty() {
                    return Err(LedgerError::Refused(format!(
                        "checkpoint {} (step {}) lacks {} committed batch(es) (first: {:?}): it is not of the \
                         committed lineage",
                        s.name,
                        s.step,
                        missing.len(),
                        &missing[..missing.len().min(5)]
                    )));
                }
                let tx = self.conn.transaction().map_err(wrap)?;
                {
                    let mut q = tx.prepare("SELECT state FROM batches WHERE batch_id = ?1").map_err(wrap)?;
                    let mut commit = tx
                        .prepare(
                            "UPDATE batches SET state = 'committed', commits = commits + 1, holder = NULL, \
                             lease_expires_ms = NULL, committed_step = ?2, trained_by = ?3 WHERE batch_id = ?1",
                        )
                        .map_err(wrap)?;
                    for &id in batch_ids {
                        let state: Option<String> = q.query_row([id as i64], |r| r.get(0)).optional().map_err(wrap)?;
                        match state.as_deref() {
                            Some("committed") => {}
                            // A batch the drafter trained was acknowledged to
                            // it (sent; or still leased, when the target's
                            // report of the acknowledgement was lost too). A
                            // pending batch was not: refused, so no client
                            // can commit work nobody did by claiming it.
                            Some("leased" | "sent" | "trained") => {
                                commit.execute(params![id as i64, s.step as i64, by]).map_err(wrap)?;
                                out.newly_committed += 1;
                            }
                            other => {
                                return Err(LedgerError::Refused(format!(
                                    "checkpoint {} (step {}) holds batch {id}, which {}",
                                    s.name,
                                    s.step,
                                    if other.is_some() {
                                        "no drafter was given (pending)"
                                    } else {
                                        "is not in the plan"
                                    }
                                )));
                            }
                        }
                    }
                }
                tx.execute(
                    "INSERT OR REPLACE INTO checkpoints (step, name, content_hash, committed_ms) VALUES (?1, ?2, ?3, ?4)",
                    params![s.step as i64, s.name, s.content_hash, crate::clock::now_ms() as i64],
                )
                .map_err(wrap)?;
                tx.commit().map_err(wrap)?;
            }
            (Some(s), _) => {
                let known = committed.iter().find(|c| c.step == s.step);
                return Err(LedgerError::Refused(match known {
                    Some(k) => format!(
                        "checkpoint {} (step {}) has content {} but the ledger committed {} with content {}",
                        s.name,
                        s.step,
                        short(&s.content_hash),
                        k.name,
                        short(&k.content_hash)
                    ),
                    None => format!(
                        "checkpoint {} (step {}) was never committed and is older than the newest commit",
                        s.name, s.step
                    ),
                }));
            }
        }
        out.redo = self.reset_uncommitted()?;
        Ok(out)
    }

    /// Batches committed after `step` go back to pending, and the
    /// checkpoints after it are forgotten. Returns how many batches.
    fn uncommit_after(&mut self, step: u64) -> Result<u64, LedgerError> {
        let path = self.path.clone();
        let wrap = |source| LedgerError::Sqlite { path: path.clone(), source };
        let tx = self.conn.transaction().map_err(wrap)?;
        let n = tx
            .execute(
                "UPDATE batches SET state = 'pending', holder = NULL, lease_expires_ms = NULL, trained_step = NULL, \
                 trained_by = NULL, committed_step = NULL, commits = commits - 1 \
                 WHERE state = 'committed' AND committed_step > ?1",
                [step as i64],
            )
            .map_err(wrap)?;
        tx.execute("DELETE FROM checkpoints WHERE step > ?1", [step as i64]).map_err(wrap)?;
        tx.commit().map_err(wrap)?;
        Ok(n as u64)
    }

    /// The drafter restarted from a checkpoint: sent and trained batches not
    /// in it go back to pending to be computed again. Returns how many.
    fn reset_uncommitted(&mut self) -> Result<u64, LedgerError> {
        self.conn
            .execute(
                "UPDATE batches SET state = 'pending', holder = NULL, lease_expires_ms = NULL, trained_step = NULL, \
                 trained_by = NULL WHERE state IN ('sent', 'trained')",
                [],
            )
            .map(|n| n as u64)
            .map_err(|e| self.err(e))
    }

    /// Every batch of the plan, in id order.
    pub fn plan(&self) -> Result<Vec<PlannedBatch>, LedgerError> {
        let mut q = self
            .conn
            .prepare("SELECT batch_id, epoch, sample_ids, sample_lengths FROM batches ORDER BY batch_id")
            .map_err(|e| self.err(e))?;
        q.query_map([], |r| {
            Ok(PlannedBatch {
                batch_id: r.get::<_, i64>(0)? as u64,
                epoch: r.get(1)?,
                sample_ids: split(&r.get::<_, String>(2)?),
                sample_lengths: split(&r.get::<_, String>(3)?),
            })
        })
        .map_err(|e| self.err(e))?
        .collect::<Result<_, _>>()
        .map_err(|e| self.err(e))
    }

    /// The plan's batches with ids from `from_batch_id` on, in id order, as
    /// many as fit in about `max_bytes` of protobuf (at least one), and
    /// whether they reach the plan's end: a page of the plan for
    /// `GetPlan`, whose responses must stay under the 4 MiB gRPC limit
    /// however long the plan (a batch's size is bounded from above: ten
    /// bytes per id, five per length, sixteen for the rest).
    pub fn plan_page(&self, from_batch_id: u64, max_bytes: usize) -> Result<(Vec<PlannedBatch>, bool), LedgerError> {
        let mut q = self
            .conn
            .prepare(
                "SELECT batch_id, epoch, sample_ids, sample_lengths FROM batches WHERE batch_id >= ?1 \
                 ORDER BY batch_id",
            )
            .map_err(|e| self.err(e))?;
        let mut rows = q
            .query_map([from_batch_id as i64], |r| {
                Ok(PlannedBatch {
                    batch_id: r.get::<_, i64>(0)? as u64,
                    epoch: r.get(1)?,
                    sample_ids: split(&r.get::<_, String>(2)?),
                    sample_lengths: split(&r.get::<_, String>(3)?),
                })
            })
            .map_err(|e| self.err(e))?;
        let (mut page, mut bytes) = (Vec::new(), 0usize);
        for row in rows.by_ref() {
            let b = row.map_err(|e| self.err(e))?;
            bytes += 16 + 10 * b.sample_ids.len() + 5 * b.sample_lengths.len();
            page.push(b);
            if bytes >= max_bytes {
                break;
            }
        }
        let complete = rows.next().is_none();
        Ok((page, complete))
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

    /// Every lease goes back to pending (they were routed to the members
    /// of a drafter generation that ended). Returns how many.
    pub fn release_all_leases(&mut self) -> Result<u64, LedgerError> {
        self.conn
            .execute(
                "UPDATE batches SET state = 'pending', holder = NULL, lease_expires_ms = NULL WHERE state = 'leased'",
                [],
            )
            .map(|n| n as u64)
            .map_err(|e| self.err(e))
    }

    /// These leased batches go back to pending.
    pub fn release_batches(&mut self, batch_ids: &[u64]) -> Result<(), LedgerError> {
        self.update_each(
            batch_ids,
            "UPDATE batches SET state = 'pending', holder = NULL, lease_expires_ms = NULL \
             WHERE batch_id = ?1 AND state = 'leased'",
            None,
        )
    }

    /// The batches not committed, in plan order: what a resumed drafter
    /// group has left to train.
    pub fn uncommitted_ids(&self) -> Result<Vec<u64>, LedgerError> {
        let mut q = self
            .conn
            .prepare("SELECT batch_id FROM batches WHERE state != 'committed' ORDER BY batch_id")
            .map_err(|e| self.err(e))?;
        q.query_map([], |r| r.get::<_, i64>(0).map(|i| i as u64))
            .map_err(|e| self.err(e))?
            .collect::<Result<_, _>>()
            .map_err(|e| self.err(e))
    }

    /// Which group member trained each batch (for the audit).
    pub fn record_members(&mut self, trained: &[(u64, String)]) -> Result<(), LedgerError> {
        let path = self.path.clone();
        let wrap = |source| LedgerError::Sqlite { path: path.clone(), source };
        let tx = self.conn.transaction().map_err(wrap)?;
        for (id, member) in trained {
            tx.execute("UPDATE batches SET trained_member = ?2 WHERE batch_id = ?1", params![*id as i64, member])
                .map_err(wrap)?;
        }
        tx.commit().map_err(wrap)
    }

    /// A coordinator starting on this ledger has heard from no target yet:
    /// every lease now ends by `deadline_ms` unless its holder renews it
    /// (a target that is still alive re-registers and renews with its next
    /// heartbeat). Without this, the leases of targets that died with the
    /// last coordinator would wait out their whole lease. Returns how many
    /// were shortened.
    pub fn shorten_leases(&mut self, deadline_ms: u64) -> Result<u64, LedgerError> {
        self.conn
            .execute(
                "UPDATE batches SET lease_expires_ms = ?1 WHERE state = 'leased' AND lease_expires_ms > ?1",
                [deadline_ms as i64],
            )
            .map(|n| n as u64)
            .map_err(|e| self.err(e))
    }

    /// Acknowledged batches not trained by their deadline go back to
    /// pending, to be leased and sent again (a drafter that took a batch and
    /// lost it would otherwise hold up every step after it). Returns how many.
    pub fn expire_sent(&mut self, now_ms: u64) -> Result<u64, LedgerError> {
        self.conn
            .execute(
                "UPDATE batches SET state = 'pending', holder = NULL, lease_expires_ms = NULL \
                 WHERE state = 'sent' AND lease_expires_ms IS NOT NULL AND lease_expires_ms < ?1",
                [now_ms as i64],
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
        let mut q = self.conn.prepare_cached("SELECT state, n FROM state_counts").map_err(|e| self.err(e))?;
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
            .prepare("SELECT batch_id, state, leases, trains, commits, trained_member FROM batches ORDER BY batch_id")
            .map_err(|e| self.err(e))?;
        q.query_map([], |r| {
            Ok(BatchAudit {
                batch_id: r.get::<_, i64>(0)? as u64,
                state: r.get(1)?,
                leases: r.get::<_, i64>(2)? as u64,
                trains: r.get::<_, i64>(3)? as u64,
                commits: r.get::<_, i64>(4)? as u64,
                member: r.get(5)?,
            })
        })
        .map_err(|e| self.err(e))?
        .collect::<Result<_, _>>()
        .map_err(|e| self.err(e))
    }

    /// Records one step's training figures. A step trained again after a
    /// resume replaces its figures: the history is the lineage's.
    pub fn record_progress(&mut self, p: &ProgressPoint) -> Result<(), LedgerError> {
        self.conn
            .execute(
                "INSERT OR REPLACE INTO progress (step, loss, accuracy, acceptance_length) VALUES (?1, ?2, ?3, ?4)",
                params![p.step as i64, f64::from(p.loss), f64::from(p.accuracy), f64::from(p.acceptance_length)],
            )
            .map(|_| ())
            .map_err(|e| self.err(e))
    }

    /// The training figures by step, about `max_points` of them evenly
    /// spread over the run (every step when there are fewer), the last step
    /// always among them. Sampled in the query: memory stays bounded however
    /// long the run.
    pub fn progress_history(&self, max_points: u64) -> Result<Vec<ProgressPoint>, LedgerError> {
        let last: Option<i64> =
            self.conn.query_row("SELECT MAX(step) FROM progress", [], |r| r.get(0)).map_err(|e| self.err(e))?;
        let Some(last) = last else { return Ok(Vec::new()) };
        let stride = (last as u64).div_ceil(max_points.max(1)).max(1) as i64;
        let mut q = self
            .conn
            .prepare(
                "SELECT step, loss, accuracy, acceptance_length FROM progress \
                 WHERE step % ?1 = 0 OR step = ?2 ORDER BY step",
            )
            .map_err(|e| self.err(e))?;
        q.query_map(params![stride, last], |r| {
            Ok(ProgressPoint {
                step: r.get::<_, i64>(0)? as u64,
                loss: r.get::<_, f64>(1)? as f32,
                accuracy: r.get::<_, f64>(2)? as f32,
                acceptance_length: r.get::<_, f64>(3)? as f32,
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

/// Bytes of a hex string (None if it is not one).
fn from_hex(hex: &str) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok()).collect()
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

    fn ckpt(step: u64, hash: &str) -> CheckpointRecord {
        CheckpointRecord { step, name: format!("step-{step:08}"), content_hash: hash.to_string() }
    }

    fn ledger(n: u64) -> (tempfile::TempDir, Ledger) {
        let dir = tempfile::tempdir().unwrap();
        let mut l = Ledger::open(&dir.path().join("l.sqlite")).unwrap();
        l.install_plan("fp", &plan(n)).unwrap();
        (dir, l)
    }

    /// The counts by a scan of the batches, as the kept counts must be.
    fn scanned(l: &Ledger) -> Counts {
        let mut q = l.conn.prepare("SELECT state, COUNT(*) FROM batches GROUP BY state").unwrap();
        let rows: BTreeMap<String, u64> =
            q.query_map([], |r| Ok((r.get(0)?, r.get::<_, i64>(1)? as u64))).unwrap().map(Result::unwrap).collect();
        let get = |k: &str| rows.get(k).copied().unwrap_or(0);
        Counts {
            pending: get("pending"),
            leased: get("leased"),
            sent: get("sent"),
            trained: get("trained"),
            committed: get("committed"),
        }
    }

    #[test]
    fn the_kept_counts_follow_every_change_of_state_and_are_recounted_at_open() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l.sqlite");
        let mut l = Ledger::open(&path).unwrap();
        l.install_plan("fp", &plan(40)).unwrap();
        assert_eq!(l.counts().unwrap(), scanned(&l));
        let check = |l: &mut Ledger, what: &str| assert_eq!(l.counts().unwrap(), scanned(l), "after {what}");
        let a = l.lease("t0", 10, 1000, 50, 0).unwrap();
        check(&mut l, "lease");
        let ids: Vec<u64> = a.iter().map(|x| x.batch_id).collect();
        l.mark_sent("t0", &ids[..6], FAR).unwrap();
        check(&mut l, "mark_sent");
        l.mark_trained("d", &ids[..4], 2).unwrap();
        check(&mut l, "mark_trained");
        l.commit_checkpoint("d", &ckpt(2, "h2"), &ids[..2]).unwrap();
        check(&mut l, "commit");
        assert_eq!(l.expire_sent(FAR + 1).unwrap(), 2);
        check(&mut l, "expire_sent");
        assert_eq!(l.release_holder("t0").unwrap(), 4);
        check(&mut l, "release_holder");
        l.lease("t1", 5, 2000, 50, 0).unwrap();
        assert_eq!(l.expire_leases(10_000).unwrap(), 5);
        check(&mut l, "expire_leases");
        l.resume("d", Some(&ckpt(2, "h2")), &ids[..2]).unwrap();
        check(&mut l, "resume");
        let before = l.counts().unwrap();
        assert_eq!(before.total(), 40);
        // A ledger whose counts are lost (written before they were kept)
        // is counted again when opened.
        l.conn.execute_batch("DELETE FROM state_counts; INSERT INTO state_counts VALUES ('pending', 7);").unwrap();
        drop(l);
        let l = Ledger::open(&path).unwrap();
        assert_eq!(l.counts().unwrap(), before);
    }

    #[test]
    fn the_plan_comes_in_pages_that_together_are_the_whole_plan() {
        let (_dir, l) = ledger(1000);
        // 16 + 2 * 10 + 2 * 5 = 46 bytes counted per batch: 22 per 1 KB page.
        let (mut got, mut from, mut pages) = (Vec::new(), 0, 0);
        loop {
            let (page, complete) = l.plan_page(from, 1000).unwrap();
            assert!(!page.is_empty() && page.len() <= 22, "{} batches in a page", page.len());
            pages += 1;
            from = page.last().unwrap().batch_id + 1;
            got.extend(page);
            if complete {
                break;
            }
        }
        assert_eq!(got, plan(1000));
        assert_eq!(pages, 1000usize.div_ceil(22));
        // A page holds at least one batch, however small the budget.
        assert_eq!(l.plan_page(5, 1).unwrap(), (plan(6)[5..].to_vec(), false));
        assert_eq!(l.plan_page(999, 1).unwrap(), (plan(1000)[999..].to_vec(), true));
        assert_eq!(l.plan_page(1000, 1 << 20).unwrap(), (Vec::new(), true));
    }

    #[test]
    fn the_progress_history_keeps_the_lineage_and_is_sampled_evenly() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l.sqlite");
        let mut l = Ledger::open(&path).unwrap();
        assert!(l.progress_history(10).unwrap().is_empty());
        let point = |step: u64, loss: f32| ProgressPoint { step, loss, accuracy: 0.5, acceptance_length: 1.5 };
        for step in 1..=1000 {
            l.record_progress(&point(step, 10.0 - step as f32 / 100.0)).unwrap();
        }
        // Steps trained again after a resume replace their figures.
        l.record_progress(&point(1000, 0.25)).unwrap();
        drop(l);
        let l = Ledger::open(&path).unwrap();
        let h = l.progress_history(64).unwrap();
        assert!((60..=65).contains(&h.len()), "{} points", h.len());
        let steps: Vec<u64> = h.iter().map(|p| p.step).collect();
        assert!(steps.windows(2).all(|w| w[1] - w[0] <= 16), "{steps:?}");
        assert_eq!(h.last().map(|p| (p.step, p.loss)), Some((1000, 0.25)));
        assert_eq!(l.progress_history(5000).unwrap().len(), 1000, "fewer than asked: every step");
    }

    #[test]
    fn batches_move_through_every_state_and_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l.sqlite");
        let mut l = Ledger::open(&path).unwrap();
        assert!(!l.install_plan("fp", &plan(4)).unwrap());
        let leases = l.lease("t0", 3, 1000, 50, 0).unwrap();
        assert_eq!(leases.iter().map(|l| l.batch_id).collect::<Vec<_>>(), vec![0, 1, 2]);
        assert_eq!(leases[1].sample_ids, vec![2, 3]);
        l.mark_sent("t0", &[0, 1], FAR).unwrap();
        l.mark_trained("d", &[0], 1).unwrap();
        l.commit_checkpoint("d", &ckpt(1, "h1"), &[0]).unwrap();
        assert_eq!(l.counts().unwrap(), Counts { pending: 1, leased: 1, sent: 1, trained: 0, committed: 1 });
        drop(l);

        let mut l = Ledger::open(&path).unwrap();
        assert!(l.install_plan("fp", &plan(4)).unwrap(), "reopen resumes");
        assert!(matches!(l.install_plan("other", &plan(4)), Err(LedgerError::PlanMismatch { .. })));
        assert_eq!(l.counts().unwrap().committed, 1);
        assert_eq!(l.checkpoints().unwrap(), vec![ckpt(1, "h1")]);
        assert_eq!(l.plan().unwrap(), plan(4));
    }

    #[test]
    fn a_reorder_window_leases_nothing_past_the_first_untrained_batch_plus_the_window() {
        let (_d, mut l) = ledger(10);
        let ids = |v: Vec<Lease>| v.into_iter().map(|l| l.batch_id).collect::<Vec<_>>();
        assert_eq!(ids(l.lease("t0", 10, 0, 50, 3).unwrap()), vec![0, 1, 2]);
        assert!(l.lease("t1", 10, 0, 50, 3).unwrap().is_empty(), "0..3 are out; 3 is past the window");
        // Batch 1 and 2 trained: 0 is still the first untrained one.
        l.mark_sent("t0", &[0, 1, 2], FAR).unwrap();
        l.mark_trained("d", &[1, 2], 2).unwrap();
        assert!(l.lease("t1", 10, 0, 50, 3).unwrap().is_empty());
        l.mark_trained("d", &[0], 3).unwrap();
        assert_eq!(ids(l.lease("t1", 10, 0, 50, 3).unwrap()), vec![3, 4, 5]);
        // A lease that expires goes back and is leased again first.
        l.expire_leases(100).unwrap();
        assert_eq!(ids(l.lease("t2", 1, 100, 50, 3).unwrap()), vec![3]);
        assert_eq!(ids(l.lease("t2", 10, 100, 50, 0).unwrap()), vec![4, 5, 6, 7, 8, 9], "no window");
    }

    #[test]
    fn the_reorder_window_counts_plan_positions_across_an_epoch_boundary() {
        let dir = tempfile::tempdir().unwrap();
        let mut l = Ledger::open(&dir.path().join("l.sqlite")).unwrap();
        let two_epochs: Vec<PlannedBatch> = (0..2u32)
            .flat_map(|e| (0..4u32).map(move |i| (e, i)))
            .map(|(e, i)| PlannedBatch {
                batch_id: dflash_data::batch_id(e, i),
                epoch: e,
                sample_ids: vec![u64::from(i)],
                sample_lengths: vec![5],
            })
            .collect();
        l.install_plan("fp", &two_epochs).unwrap();
        let ids: Vec<u64> = two_epochs.iter().map(|b| b.batch_id).collect();
        let leased = |v: Vec<Lease>| v.into_iter().map(|l| l.batch_id).collect::<Vec<_>>();
        assert_eq!(leased(l.lease("t", 3, 0, 50, 3).unwrap()), ids[..3].to_vec());
        l.mark_sent("t", &ids[..3], FAR).unwrap();
        l.mark_trained("d", &ids[..3], 3).unwrap();
        // The last batch of epoch 0 is out (a group member holds it and
        // waits for its partner's next batch): the window still reaches
        // into epoch 1, whose ids are 2^32 further on.
        assert_eq!(leased(l.lease("t", 1, 0, 50, 3).unwrap()), vec![ids[3]]);
        l.mark_sent("t", &ids[3..4], FAR).unwrap();
        assert_eq!(leased(l.lease("t", 10, 0, 50, 3).unwrap()), ids[4..6].to_vec(), "positions 4 and 5 of 3..6");
    }

    #[test]
    fn a_restarted_coordinator_ends_the_leases_nobody_renews_soon() {
        let (_d, mut l) = ledger(4);
        l.lease("dead", 2, 1000, 120_000, 0).unwrap(); // 0, 1 until 121000
        l.lease("alive", 2, 1000, 120_000, 0).unwrap(); // 2, 3
        // Started again at 5000 with an instance timeout of 3000.
        assert_eq!(l.shorten_leases(8000).unwrap(), 4);
        l.renew("alive", &[2, 3], 5200, 120_000).unwrap(); // re-registered, heartbeat
        assert_eq!(l.expire_leases(8001).unwrap(), 2, "the dead target's two");
        assert_eq!(l.counts().unwrap().pending, 2);
        assert_eq!(l.shorten_leases(9000).unwrap(), 2, "a later start shortens them again");
    }

    /// A deadline no test reaches.
    const FAR: u64 = 1 << 50;

    #[test]
    fn an_acknowledged_batch_not_trained_by_its_deadline_goes_back_to_pending() {
        let (_d, mut l) = ledger(4);
        l.lease("t0", 3, 1000, 50, 0).unwrap();
        l.mark_sent("t0", &[0, 1], 5000).unwrap();
        l.mark_sent("t0", &[2], 9000).unwrap();
        l.mark_trained("d", &[1], 1).unwrap();
        assert_eq!(l.expire_sent(5000).unwrap(), 0, "not before the deadline");
        assert_eq!(l.expire_sent(5001).unwrap(), 1, "batch 0: acknowledged, never trained");
        let c = l.counts().unwrap();
        assert_eq!((c.pending, c.sent, c.trained), (2, 1, 1), "0 and 3 pending, 2 still in time, 1 trained");
        // Leased again first, and trained once the replay arrives.
        assert_eq!(l.lease("t1", 1, 6000, 50, 0).unwrap()[0].batch_id, 0);
        l.mark_sent("t1", &[0], 20_000).unwrap();
        l.mark_trained("d", &[0], 2).unwrap();
        assert_eq!(l.audit().unwrap()[0].leases, 2);
        assert_eq!(l.audit().unwrap()[0].trains, 1);
    }

    #[test]
    fn failures_return_work_to_pending() {
        let (_d, mut l) = ledger(6);
        l.lease("t0", 2, 1000, 50, 0).unwrap(); // 0, 1 expire at 1050
        l.lease("t1", 2, 1000, 500, 0).unwrap(); // 2, 3
        l.renew("t0", &[0], 1040, 50).unwrap(); // 0 now expires at 1090
        assert_eq!(l.expire_leases(1060).unwrap(), 1, "batch 1 expired");

        assert_eq!(l.release_holder("t1").unwrap(), 2, "dead target's leases");
        l.mark_sent("t0", &[0], FAR).unwrap();
        l.mark_trained("d", &[0], 1).unwrap();
        let r = l.resume("d2", None, &[]).unwrap();
        assert_eq!(r.redo, 1, "drafter restart from nothing, nothing committed yet");
        assert_eq!(l.counts().unwrap().pending, 6);
        let again = l.lease("t2", 10, 2000, 50, 0).unwrap();
        assert_eq!(again.len(), 6);
        assert_eq!(l.audit().unwrap()[0].leases, 2);
    }

    #[test]
    fn commits_are_idempotent() {
        let (_d, mut l) = ledger(2);
        l.lease("t0", 2, 0, 50, 0).unwrap();
        l.mark_trained("d", &[0, 1], 1).unwrap();
        l.commit_checkpoint("d", &ckpt(1, "h"), &[0, 1]).unwrap();
        l.commit_checkpoint("d", &ckpt(1, "h"), &[0, 1]).unwrap();
        assert!(l.audit().unwrap().iter().all(|a| a.commits == 1 && a.trains == 1));
    }

    #[test]
    fn a_batch_trained_after_its_target_was_presumed_dead_commits() {
        let (_d, mut l) = ledger(2);
        l.lease("t0", 2, 0, 50, 0).unwrap();
        // t0 sent batch 0 and was cut off before reporting it: its leases
        // go back to pending, and then the drafter reports training it.
        assert_eq!(l.release_holder("t0").unwrap(), 2);
        l.mark_trained("d", &[0], 1).unwrap();
        l.commit_checkpoint("d", &ckpt(1, "h"), &[0]).unwrap();
        assert_eq!(l.counts().unwrap(), Counts { pending: 1, leased: 0, sent: 0, trained: 0, committed: 1 });
    }

    #[test]
    fn only_the_drafter_that_trained_a_batch_can_commit_it() {
        let (_d, mut l) = ledger(4);
        l.lease("t0", 4, 0, 50, 0).unwrap();
        l.mark_trained("d", &[0, 1], 1).unwrap();
        // Batches never trained (leased, pending) or trained by another
        // drafter: the whole report is refused and nothing changes.
        for (by, ids) in [("d", vec![0, 1, 2]), ("intruder", vec![0, 1]), ("d", vec![0, 99])] {
            let err = l.commit_checkpoint(by, &ckpt(1, "h"), &ids).unwrap_err();
            assert!(matches!(err, LedgerError::Refused(_)), "{err}");
            assert_eq!(l.counts().unwrap().committed, 0, "{err}");
        }
        assert!(l.checkpoints().unwrap().is_empty());
        l.commit_checkpoint("d", &ckpt(1, "h"), &[0, 1]).unwrap();
        assert_eq!(l.counts().unwrap().committed, 2);
    }

    #[test]
    fn a_drafter_must_resume_from_what_was_committed() {
        let (_d, mut l) = ledger(6);
        l.lease("t0", 6, 0, 50, 0).unwrap();
        l.mark_trained("d", &[0, 1], 1).unwrap();
        l.commit_checkpoint("d", &ckpt(1, "h1"), &[0, 1]).unwrap();
        l.mark_trained("d", &[2, 3], 2).unwrap();
        l.commit_checkpoint("d", &ckpt(2, "h2"), &[0, 1, 2, 3]).unwrap();
        l.mark_trained("d", &[4], 3).unwrap();

        // Nothing, a wrong content, an unknown older step: refused, and the
        // ledger is untouched.
        for start in [None, Some(ckpt(2, "corrupt")), Some(ckpt(1, "h2"))] {
            let err = l.resume("d2", start.as_ref(), &[]).unwrap_err();
            assert!(matches!(err, LedgerError::Refused(_)), "{err}");
        }
        let err = l.resume("d2", None, &[]).unwrap_err().to_string();
        assert!(err.contains("step 2") && err.contains("random weights"), "{err}");
        assert_eq!(l.counts().unwrap().committed, 4);

        // The newest committed one: what it does not hold is redone.
        let r = l.resume("d2", Some(&ckpt(2, "h2")), &[0, 1, 2, 3]).unwrap();
        assert_eq!(r, Resumed { redo: 1, uncommitted: 0, newly_committed: 0 });

        // A fall-back to an older committed one: later commits are undone.
        let r = l.resume("d3", Some(&ckpt(1, "h1")), &[0, 1]).unwrap();
        assert_eq!(r.uncommitted, 2);
        assert_eq!(l.counts().unwrap().committed, 2);
        assert_eq!(l.checkpoints().unwrap(), vec![ckpt(1, "h1")]);
        assert!(l.audit().unwrap().iter().all(|a| a.commits <= 1));
    }

    #[test]
    fn a_newer_checkpoint_whose_report_was_lost_is_committed_on_resume() {
        let (_d, mut l) = ledger(5);
        l.lease("t0", 5, 0, 50, 0).unwrap();
        l.mark_trained("d", &[0, 1], 1).unwrap();
        l.commit_checkpoint("d", &ckpt(1, "h1"), &[0, 1]).unwrap();
        l.mark_sent("t0", &[2, 3], FAR).unwrap();
        // Step 2's training and checkpoint reports were lost: 2 and 3 stay
        // sent. It must hold every committed batch.
        let err = l.resume("d2", Some(&ckpt(2, "h2")), &[0, 2, 3]).unwrap_err();
        assert!(err.to_string().contains("lacks 1 committed"), "{err}");
        let r = l.resume("d2", Some(&ckpt(2, "h2")), &[0, 1, 2, 3]).unwrap();
        assert_eq!(r.newly_committed, 2);
        assert_eq!(l.counts().unwrap(), Counts { pending: 0, leased: 1, sent: 0, trained: 0, committed: 4 });
        assert_eq!(l.checkpoints().unwrap()[0], ckpt(2, "h2"));
    }

    #[test]
    fn ledgers_written_before_the_checkpoint_columns_open_and_migrate() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("old.sqlite");
        {
            let c = Connection::open(&path).unwrap();
            c.execute_batch(
                "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
                 CREATE TABLE batches (batch_id INTEGER PRIMARY KEY, epoch INTEGER NOT NULL, sample_ids TEXT NOT NULL,
                   sample_lengths TEXT NOT NULL, state TEXT NOT NULL, holder TEXT, lease_expires_ms INTEGER,
                   trained_step INTEGER, leases INTEGER NOT NULL DEFAULT 0, trains INTEGER NOT NULL DEFAULT 0,
                   commits INTEGER NOT NULL DEFAULT 0);
                 INSERT INTO batches (batch_id, epoch, sample_ids, sample_lengths, state) VALUES (0, 0, '1', '5', 'pending');",
            )
            .unwrap();
        }
        let mut l = Ledger::open(&path).unwrap();
        l.lease("t", 1, 0, 50, 0).unwrap();
        l.mark_trained("d", &[0], 1).unwrap();
        l.commit_checkpoint("d", &ckpt(1, "h"), &[0]).unwrap();
        assert_eq!(l.counts().unwrap().committed, 1);
    }
}
