//! The train loop: one optimizer step per batch, progress to the log and
//! the coordinator, checkpoints on the interval, on SIGTERM and at the end.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dflash_models::checkpoint::{TrainerState, latest_checkpoint, restore_checkpoint, save_checkpoint};
use dflash_models::{DeviceBatch, StepOutcome, Trainer};
use dflash_proto as pb;
use dflash_role::{KindExt, Session, StopCause, with_timeout};
use dflash_telemetry::ErrorKind;

use crate::eval::PeriodicEval;
use crate::receiver::ReceivedBatch;

/// Batch ids trained in this checkpoint lineage.
pub type TrainedSet = Arc<Mutex<BTreeSet<u64>>>;

/// What happened to one replica's batch in one step.
pub enum ReplicaOutcome {
    Trained(dflash_models::StepMetrics),
    Skipped(String),
    /// Already trained in this lineage (a replay whose ack was lost).
    Duplicate,
}

/// One replica's part of one step.
pub struct ReplicaReport {
    pub batch_id: Option<u64>,
    pub outcome: ReplicaOutcome,
    /// Time spent computing (not waiting for a batch).
    pub busy: Duration,
}

/// What all replicas agreed on for one step.
pub struct Agreement {
    pub any_batch: bool,
    pub stopping: bool,
}

/// One replica's side of the lockstep: take a batch if one comes within a
/// short wait, compute its gradients, agree with the other replicas on who
/// contributes and whether to stop, average gradients, step. Every replica
/// takes the same optimizer steps, so their weights stay identical.
pub struct ReplicaStep {
    pub input: flume::Receiver<DeviceBatch>,
    pub group: Option<dflash_models::dp::Replica>,
    pub trained: TrainedSet,
    pub device: tch::Device,
    /// Verify every this many steps that the replicas hold identical weights.
    pub check_every: u64,
}

impl ReplicaStep {
    pub fn world(&self) -> usize {
        self.group.as_ref().map_or(1, |g| g.world)
    }

    pub fn step(
        &mut self,
        trainer: &mut dflash_models::Trainer,
        stop: &dflash_role::Stop,
    ) -> anyhow::Result<(ReplicaReport, Agreement)> {
        let batch = match self.input.recv_timeout(Duration::from_millis(100)) {
            Ok(b) => Some(b),
            Err(flume::RecvTimeoutError::Timeout) => None,
            Err(flume::RecvTimeoutError::Disconnected) => None,
        };
        let t0 = Instant::now();
        let span = batch.as_ref().map(|b| dflash_telemetry::batch_span("train_step", &b.trace_context, b.batch_id));
        let _entered = span.as_ref().map(tracing::Span::enter);
        let mut report = ReplicaReport {
            batch_id: batch.as_ref().map(|b| b.batch_id),
            outcome: ReplicaOutcome::Duplicate,
            busy: Duration::ZERO,
        };
        let mut contributes = false;
        let mut pending = None;
        if let Some(b) = &batch {
            let dup = self.trained.lock().expect("trained set lock").contains(&b.batch_id);
            if !dup {
                match trainer.compute_gradients(b) {
                    StepOutcome::Trained(m) => {
                        contributes = true;
                        pending = Some(m);
                    }
                    StepOutcome::Skipped(r) => report.outcome = ReplicaOutcome::Skipped(r),
                }
            }
        }
        let flags = [
            f32::from(u8::from(contributes)),
            f32::from(u8::from(batch.is_some())),
            f32::from(u8::from(stop.is_stopped())),
        ];
        let agreed = match &self.group {
            Some(g) => g.agree(&flags, self.device).kind(ErrorKind::Device)?,
            None => flags.to_vec(),
        };
        let agreement = Agreement { any_batch: agreed[1] > 0.0, stopping: agreed[2] > 0.0 };
        if !agreement.stopping && agreed[0] > 0.0 {
            if let Some(g) = &self.group {
                g.average_gradients(&trainer.drafter.named_parameters(), agreed[0]).kind(ErrorKind::Device)?;
            }
            match trainer.apply_gradients(pending.take().unwrap_or_default()) {
                StepOutcome::Trained(m) if contributes => report.outcome = ReplicaOutcome::Trained(m),
                StepOutcome::Trained(_) => {}
                StepOutcome::Skipped(r) if contributes => report.outcome = ReplicaOutcome::Skipped(r),
                StepOutcome::Skipped(_) => {}
            }
            if let Some(g) = &self.group
                && trainer.step().is_multiple_of(self.check_every.max(1))
            {
                let sum =
                    g.check_identical(&trainer.drafter.named_parameters(), self.device).kind(ErrorKind::Device)?;
                if g.rank == 0 {
                    tracing::info!(
                        "step {}: weights identical on all {} replicas (checksum {sum:.6e})",
                        trainer.step(),
                        g.world
                    );
                }
            }
        }
        report.busy = t0.elapsed();
        Ok((report, agreement))
    }
}

/// A replica other than the leader: steps in lockstep and reports each
/// step it took part in to the leader.
pub fn follow(
    mut trainer: dflash_models::Trainer,
    mut replica: ReplicaStep,
    stop: dflash_role::Stop,
    reports: flume::Sender<ReplicaReport>,
) -> anyhow::Result<()> {
    loop {
        let (report, flags) = replica.step(&mut trainer, &stop)?;
        if flags.stopping {
            return Ok(());
        }
        if flags.any_batch && reports.send(report).is_err() {
            return Ok(());
        }
    }
}

pub struct TrainLoop {
    pub trainer: Trainer,
    pub session: Arc<Session>,
    pub rt: tokio::runtime::Handle,
    pub checkpoint_dir: PathBuf,
    /// For logging how full the HS queue is.
    pub hs_queue: flume::Sender<ReceivedBatch>,
    /// Held-out acceptance-length evaluation, when configured.
    pub eval: Option<PeriodicEval>,
    /// Every batch trained in this checkpoint lineage, in order.
    trained: Vec<u64>,
    /// The same ids as a set, shared with the replicas (duplicate check).
    pub trained_set: TrainedSet,
    /// Trained batches not yet reported to the coordinator.
    unreported: Vec<pb::TrainedBatch>,
    last_checkpoint_step: u64,
    /// How many of `trained` the last checkpoint holds.
    checkpointed: usize,
    bad_in_a_row: u32,
    /// Fraction of the current log window spent waiting for input.
    input_wait: f32,
}

/// Window of throughput accounting for the log line.
struct Window {
    started: Instant,
    tokens: u64,
    wait: Duration,
}

impl TrainLoop {
    pub fn new(
        trainer: Trainer,
        session: Arc<Session>,
        rt: tokio::runtime::Handle,
        hs_queue: flume::Sender<ReceivedBatch>,
    ) -> Self {
        let checkpoint_dir = PathBuf::from(&session.config.checkpoint.dir);
        Self {
            trainer,
            session,
            rt,
            checkpoint_dir,
            hs_queue,
            eval: None,
            trained: Vec::new(),
            trained_set: TrainedSet::default(),
            unreported: Vec::new(),
            last_checkpoint_step: 0,
            checkpointed: 0,
            bad_in_a_row: 0,
            input_wait: 0.0,
        }
    }

    /// Restores the latest checkpoint, if any, and tells the coordinator
    /// where this drafter starts, so that uncommitted work is redone.
    pub fn resume(&mut self) -> anyhow::Result<()> {
        let mut path = String::new();
        if let Some(dir) = latest_checkpoint(&self.checkpoint_dir).kind(ErrorKind::Checkpoint)? {
            let state = restore_checkpoint(&dir, &mut self.trainer).kind(ErrorKind::Checkpoint)?;
            if !state.run_id.is_empty() && state.run_id != self.session.run_id {
                return Err(anyhow::anyhow!(
                    "checkpoint {} belongs to run {} but this is run {}; use another checkpoint.dir",
                    dir.display(),
                    state.run_id,
                    self.session.run_id
                ))
                .kind(ErrorKind::Checkpoint);
            }
            tracing::info!("resumed from {} at step {} ({} batches)", dir.display(), state.step, state.batch_ids.len());
            *self.trained_set.lock().expect("trained set lock") = state.batch_ids.iter().copied().collect();
            self.trained = state.batch_ids;
            self.last_checkpoint_step = state.step;
            self.checkpointed = self.trained.len();
            path = dir.display().to_string();
        }
        let req = pb::ReportCheckpointRequest {
            run_id: self.session.run_id.clone(),
            instance_id: self.session.instance_id.clone(),
            step: self.trainer.step(),
            path,
            batch_ids: self.trained.clone(),
            resumed: true,
        };
        self.rt
            .block_on(with_timeout(self.session.rpc_timeout(), self.session.client().report_checkpoint(req)))
            .map_err(|s| anyhow::anyhow!("reporting the starting checkpoint: {}", s.message()))
            .kind(ErrorKind::PeerLost)?;
        Ok(())
    }

    /// Trains until every batch is trained or the role stops. This thread
    /// is replica 0 (the leader: it reports, logs and checkpoints); other
    /// replicas run [`follow`] and send one [`ReplicaReport`] per step.
    pub fn run(mut self, mut replica: ReplicaStep, followers: flume::Receiver<ReplicaReport>) -> anyhow::Result<()> {
        let stop = self.session.stop.clone();
        let c = self.session.config.clone();
        let mut win = Window { started: Instant::now(), tokens: 0, wait: Duration::ZERO };
        let world = replica.world();
        loop {
            let wait_start = Instant::now();
            let (own, flags) = replica.step(&mut self.trainer, &stop)?;
            let step_seconds = own.busy.as_secs_f64();
            win.wait += wait_start.elapsed().saturating_sub(own.busy);
            if flags.stopping {
                break;
            }
            if !flags.any_batch {
                continue;
            }
            // Exactly one report per replica for every step anyone took.
            let mut reports = vec![own];
            while reports.len() < world {
                match followers.recv_timeout(Duration::from_millis(200)) {
                    Ok(r) => reports.push(r),
                    Err(flume::RecvTimeoutError::Timeout) if !stop.is_stopped() => {}
                    Err(_) => anyhow::bail!("a drafter replica stopped answering"),
                }
            }
            let mut metrics = None;
            let mut step_tokens = 0u64;
            let mut skipped_reasons = Vec::new();
            for r in reports {
                let Some(id) = r.batch_id else { continue };
                match r.outcome {
                    ReplicaOutcome::Duplicate => {
                        tracing::info!("batch {id} was already trained; not training it again");
                        dflash_telemetry::metrics().batches.with_label_values(&["duplicate"]).inc();
                        self.unreported.push(pb::TrainedBatch {
                            batch_id: id,
                            skipped: false,
                            skip_reason: String::new(),
                        });
                    }
                    ReplicaOutcome::Trained(m) => {
                        self.record(id);
                        self.unreported.push(pb::TrainedBatch {
                            batch_id: id,
                            skipped: false,
                            skip_reason: String::new(),
                        });
                        win.tokens += m.tokens;
                        step_tokens += m.tokens;
                        metrics.get_or_insert(m);
                    }
                    ReplicaOutcome::Skipped(reason) => {
                        self.record(id);
                        self.unreported.push(pb::TrainedBatch {
                            batch_id: id,
                            skipped: true,
                            skip_reason: reason.clone(),
                        });
                        skipped_reasons.push(reason);
                        dflash_telemetry::metrics().batches.with_label_values(&["skipped"]).inc();
                        dflash_telemetry::metrics().errors.with_label_values(&["non_finite"]).inc();
                    }
                }
            }
            if metrics.is_some() {
                self.bad_in_a_row = 0;
            }
            for reason in skipped_reasons {
                self.bad_in_a_row += 1;
                tracing::warn!("skipped {reason} ({} in a row)", self.bad_in_a_row);
                if self.bad_in_a_row >= c.training.max_bad_batches_in_a_row {
                    return Err(anyhow::anyhow!(
                        "{} batches in a row had non-finite features, loss or gradients (last: {reason}); \
                         training.max_bad_batches_in_a_row = {}",
                        self.bad_in_a_row,
                        c.training.max_bad_batches_in_a_row
                    ))
                    .kind(ErrorKind::NonFinite);
                }
            }
            let step = self.trainer.step();
            if let Some(m) = &metrics
                && (step.is_multiple_of(c.run.log_every_steps.max(1)) || step == 1)
            {
                let secs = win.started.elapsed().as_secs_f64();
                tracing::info!(
                    "step {step}/{} | loss {:.4} | acc {:.3} | accept {:.2} | lr {:.2e} | grad {:.2} | {:.0} tok/s | queue {}/{} | wait {:.0}%",
                    c.training.total_steps,
                    m.loss,
                    m.accuracy,
                    m.acceptance_length,
                    m.lr,
                    m.grad_norm,
                    win.tokens as f64 / secs,
                    self.hs_queue.len(),
                    c.pipeline.hs_queue_depth,
                    100.0 * win.wait.as_secs_f64() / secs
                );
                win = Window { started: Instant::now(), tokens: 0, wait: Duration::ZERO };
            }
            let secs = win.started.elapsed().as_secs_f64().max(1e-9);
            self.input_wait = (win.wait.as_secs_f64() / secs) as f32;
            export_step_metrics(
                step,
                metrics.as_ref(),
                step_tokens,
                self.input_wait,
                self.hs_queue.len(),
                step_seconds,
            );
            let all_trained = self.report_trained(metrics.as_ref(), step_tokens)?;
            if step > 0 && step.is_multiple_of(c.checkpoint.interval_steps) && step != self.last_checkpoint_step {
                self.checkpoint()?;
            }
            if let Some(e) = &self.eval
                && metrics.is_some()
                && e.every > 0
                && step.is_multiple_of(e.every)
                && !all_trained
            {
                e.run(step, &self.trainer);
            }
            if all_trained {
                if let Some(e) = self.eval.as_ref().filter(|e| e.every > 0) {
                    e.run(step, &self.trainer);
                }
                if self.trained.len() > self.checkpointed {
                    tracing::info!("every batch of the run is trained: final checkpoint");
                    self.checkpoint()?;
                }
                // The coordinator now completes the run and stops every
                // role; replicas leave together at the next agreement.
                stop.stopped_blocking();
            }
        }
        // Stopped: a signal (SIGTERM from Kubernetes, Ctrl-C) checkpoints
        // first so that no trained step is lost.
        if matches!(stop.cause(), Some(StopCause::Signal(_))) && self.trained.len() > self.checkpointed {
            tracing::info!("checkpointing step {} before exit", self.trainer.step());
            self.checkpoint()?;
        }
        Ok(())
    }

    fn record(&mut self, id: u64) {
        self.trained.push(id);
        self.trained_set.lock().expect("trained set lock").insert(id);
    }

    /// Reports trained batches; true when the coordinator says every batch
    /// of the run is trained. Unreachable coordinator: keep them for later.
    fn report_trained(&mut self, m: Option<&dflash_models::StepMetrics>, tokens: u64) -> anyhow::Result<bool> {
        let m = m.cloned().unwrap_or_default();
        let req = pb::ReportTrainedRequest {
            run_id: self.session.run_id.clone(),
            instance_id: self.session.instance_id.clone(),
            step: self.trainer.step(),
            batches: self.unreported.clone(),
            loss: m.loss as f32,
            accuracy: m.accuracy as f32,
            acceptance_length: m.acceptance_length as f32,
            tokens,
            input_wait_fraction: self.input_wait,
        };
        match self.rt.block_on(with_timeout(self.session.rpc_timeout(), self.session.client().report_trained(req))) {
            Ok(r) => {
                self.unreported.clear();
                Ok(r.all_trained)
            }
            Err(s) if s.code() == tonic::Code::FailedPrecondition => {
                Err(anyhow::anyhow!("coordinator: {}", s.message())).kind(ErrorKind::Protocol)
            }
            Err(s) => {
                tracing::warn!("could not report progress ({}); will retry", s.message());
                Ok(false)
            }
        }
    }

    fn checkpoint(&mut self) -> anyhow::Result<()> {
        let t0 = Instant::now();
        let state = TrainerState {
            step: self.trainer.step(),
            batch_ids: self.trained.clone(),
            run_config: self.session.config_toml(),
            run_id: self.session.run_id.clone(),
        };
        let keep = self.session.config.checkpoint.keep_last as usize;
        let dir = save_checkpoint(&self.checkpoint_dir, &self.trainer, &state, keep).kind(ErrorKind::Checkpoint)?;
        self.last_checkpoint_step = state.step;
        self.checkpointed = self.trained.len();
        tracing::info!("checkpoint {} written in {:.2} s", dir.display(), t0.elapsed().as_secs_f64());
        // Trained batches must be known to the ledger before they commit.
        self.report_trained(None, 0)?;
        self.report_checkpoint(dir)
    }

    fn report_checkpoint(&mut self, dir: PathBuf) -> anyhow::Result<()> {
        let req = pb::ReportCheckpointRequest {
            run_id: self.session.run_id.clone(),
            instance_id: self.session.instance_id.clone(),
            step: self.last_checkpoint_step,
            path: dir.display().to_string(),
            batch_ids: self.trained.clone(),
            resumed: false,
        };
        match self.rt.block_on(with_timeout(self.session.rpc_timeout(), self.session.client().report_checkpoint(req))) {
            Ok(_) => Ok(()),
            Err(s) if s.code() == tonic::Code::FailedPrecondition => {
                Err(anyhow::anyhow!("coordinator: {}", s.message())).kind(ErrorKind::Protocol)
            }
            Err(s) => {
                // The checkpoint is on disk; a restart reports it again.
                tracing::warn!("could not report checkpoint {}: {}", dir.display(), s.message());
                Ok(())
            }
        }
    }
}

/// The leader's view of one step, for the metrics endpoint.
fn export_step_metrics(
    step: u64,
    m: Option<&dflash_models::StepMetrics>,
    tokens: u64,
    input_wait: f32,
    queue: usize,
    step_seconds: f64,
) {
    let g = dflash_telemetry::metrics();
    g.step.set(step as f64);
    g.idle_fraction.with_label_values(&["train"]).set(f64::from(input_wait));
    g.queue_depth.with_label_values(&["hs_queue"]).set(queue as i64);
    if let Some(m) = m {
        g.tokens.with_label_values(&["trained"]).inc_by(tokens);
        g.batches.with_label_values(&["trained"]).inc();
        g.loss.set(m.loss);
        g.accuracy.set(m.accuracy);
        g.acceptance_length.with_label_values(&["simulated"]).set(m.acceptance_length);
        g.step_seconds.observe(step_seconds);
    }
}
