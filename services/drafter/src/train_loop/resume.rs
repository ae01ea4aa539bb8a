//! Where a drafter starts: the newest intact checkpoint the coordinator's
//! ledger committed (or a newer one whose report was lost), never random
//! weights once anything was committed.

use std::path::{Path, PathBuf};

use dflash_models::checkpoint::{
    Checkpoint, check_writable, point_latest, read_trainer_state, remove_stale_temporaries, restore_checkpoint,
    set_aside, step_dirs, verify_checkpoint,
};
use dflash_proto as pb;
use dflash_role::{KindExt, with_timeout};
use dflash_telemetry::ErrorKind;

use super::TrainLoop;
use super::checkpoints::short;

/// Why a checkpoint directory cannot be resumed from.
struct NotResumable(String);

impl TrainLoop {
    /// One control RPC, bounded by the RPC timeout.
    fn rpc<T>(
        &self,
        call: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T, tonic::Status> {
        self.rt.block_on(with_timeout(self.session.rpc_timeout(), call))
    }

    /// Starts from what the coordinator's ledger committed, and tells it
    /// where this drafter starts so that the work it does not hold is
    /// redone. Tries, in order: checkpoints on disk at or after the newest
    /// commit (a newer one whose report was lost is committed now), then
    /// older committed ones; each must match its manifest (and the content
    /// the ledger recorded). Damaged or refused ones are set aside. A fresh
    /// start is allowed only while nothing is committed.
    pub fn resume(&mut self) -> anyhow::Result<()> {
        let root = self.checkpoint_dir.clone();
        check_writable(&root)
            .map_err(|e| anyhow::anyhow!("checkpoint.dir {} cannot hold checkpoints: {e}", root.display()))
            .kind(ErrorKind::Checkpoint)?;
        for p in remove_stale_temporaries(&root).kind(ErrorKind::Checkpoint)? {
            tracing::info!("removed {}, left by an interrupted checkpoint write", p.display());
        }
        let req = pb::ListCheckpointsRequest {
            run_id: self.session.run_id.clone(),
            instance_id: self.session.instance_id.clone(),
        };
        let committed = self
            .rpc(self.session.client().list_checkpoints(req))
            .map_err(|s| anyhow::anyhow!("asking the coordinator for the committed checkpoints: {}", s.message()))
            .kind(ErrorKind::PeerLost)?
            .checkpoints;
        let newest = committed.first().map_or(0, |c| c.step);
        let mut candidates: Vec<PathBuf> = step_dirs(&root)
            .kind(ErrorKind::Checkpoint)?
            .into_iter()
            .filter(|(step, _)| *step >= newest)
            .map(|(_, dir)| dir)
            .collect();
        for c in &committed {
            let dir = root.join(&c.name);
            if !candidates.contains(&dir) {
                candidates.push(dir);
            }
        }
        let mut tried = Vec::new();
        for dir in candidates {
            match self.try_resume_from(&dir, &committed)? {
                Ok(()) => {
                    if !tried.is_empty() {
                        tracing::warn!("resumed from {} after passing over: {}", dir.display(), tried.join("; "));
                    }
                    point_latest(&root, &dir).kind(ErrorKind::Checkpoint)?;
                    return Ok(());
                }
                Err(NotResumable(why)) => {
                    tracing::warn!("not resuming from {}: {why}", dir.display());
                    if dir.exists() {
                        let aside = set_aside(&dir).kind(ErrorKind::Checkpoint)?;
                        tracing::warn!("set {} aside as {}", dir.display(), aside.display());
                    }
                    tried.push(format!("{}: {why}", dir.display()));
                }
            }
        }
        if let Some(n) = committed.first() {
            return Err(anyhow::anyhow!(
                "the ledger committed checkpoints up to step {} ({}), but none of them is intact in {}{}; refusing \
                 to start from random weights and lose that training (is checkpoint.dir the run's volume?)",
                n.step,
                n.name,
                root.display(),
                if tried.is_empty() { String::new() } else { format!(" (tried: {})", tried.join("; ")) }
            ))
            .kind(ErrorKind::CheckpointUnavailable);
        }
        // A fresh run: the coordinator checks that nothing is committed.
        self.report_start(None, Vec::new())
            .map_err(|s| anyhow::anyhow!("starting from scratch: {}", s.message()))
            .kind(ErrorKind::Checkpoint)?;
        Ok(())
    }

    /// Resumes from `dir` if it is intact, of this run, and the coordinator
    /// accepts it; `Ok(Err(why))` when it cannot be resumed from.
    fn try_resume_from(
        &mut self,
        dir: &Path,
        committed: &[pb::CommittedCheckpoint],
    ) -> anyhow::Result<Result<(), NotResumable>> {
        if !dir.exists() {
            return Ok(Err(NotResumable("missing".into())));
        }
        let ck = match verify_checkpoint(dir) {
            Ok(ck) => ck,
            Err(e) => return Ok(Err(NotResumable(e.to_string()))),
        };
        if let Some(c) = committed.iter().find(|c| c.step == ck.step)
            && c.content_hash != ck.content_hash
        {
            return Ok(Err(NotResumable(format!(
                "its content {} is not the {} the ledger committed",
                short(&ck.content_hash),
                short(&c.content_hash)
            ))));
        }
        let state = match read_trainer_state(dir) {
            Ok(s) => s,
            Err(e) => return Ok(Err(NotResumable(e.to_string()))),
        };
        if !state.run_id.is_empty() && state.run_id != self.session.run_id {
            return Ok(Err(NotResumable(format!("it belongs to run {}, not {}", state.run_id, self.session.run_id))));
        }
        match self.report_start(Some(&ck), state.batch_ids.clone()) {
            Ok(()) => {}
            Err(s) if refused(&s) => {
                return Ok(Err(NotResumable(format!("the coordinator refused it: {}", s.message()))));
            }
            Err(s) => {
                return Err(anyhow::anyhow!("reporting the starting checkpoint: {}", s.message()))
                    .kind(ErrorKind::PeerLost);
            }
        }
        let state = restore_checkpoint(dir, &mut self.trainer).kind(ErrorKind::Checkpoint)?;
        tracing::info!(
            "resumed from {} at step {} ({} batches, content {})",
            dir.display(),
            state.step,
            state.batch_ids.len(),
            short(&ck.content_hash)
        );
        self.trained_set.reset_to(state.batch_ids.iter().copied());
        self.trained = state.batch_ids;
        self.last_checkpoint_step = state.step;
        self.checkpointed = self.trained.len();
        Ok(Ok(()))
    }

    /// Tells the coordinator this drafter starts from `ck` (None: nothing).
    fn report_start(&self, ck: Option<&Checkpoint>, batch_ids: Vec<u64>) -> Result<(), tonic::Status> {
        let req = pb::ReportCheckpointRequest {
            run_id: self.session.run_id.clone(),
            instance_id: self.session.instance_id.clone(),
            step: ck.map_or(0, |c| c.step),
            path: ck.map_or_else(String::new, |c| c.dir.display().to_string()),
            batch_ids,
            resumed: true,
            content_hash: ck.map_or_else(String::new, |c| c.content_hash.clone()),
        };
        self.rpc(self.session.client().report_checkpoint(req)).map(|_| ())
    }
}

/// Whether the coordinator refused a report for good (the written policy
/// says no retry helps); else it is sent again.
fn refused(s: &tonic::Status) -> bool {
    let e = dflash_proto::CoordinatorError::from_status(s);
    dflash_telemetry::on_coordinator_error(e.as_ref()) == dflash_telemetry::Reaction::Fail
}
