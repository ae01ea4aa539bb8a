//! The train loop: one optimizer step per batch, progress to the log and
//! the coordinator, checkpoints on the interval, on SIGTERM and at the end.
//!
//! Nothing trained is lost to a failure around it: the loop starts from the
//! checkpoint the coordinator's ledger committed (verified against its
//! manifest, or an older committed one when it is damaged; never from
//! random weights once anything was committed); a checkpoint write that
//! fails (a full disk) leaves the last good one, is reported and retried
//! with backoff while training goes on. Reports go through the
//! [`Reporter`], off this thread; the coordinator gets them again until it
//! has taken them.
//!
//! The leader's step driver is here; the rest by concern: one replica's
//! step (`replica`) and what it reports (`step`), the drafter group's
//! lockstep (`lockstep`), the checkpoint hand-off (`checkpoints`), where a
//! drafter starts (`resume`), evaluation during training (`evaluation`), and
//! the progress log and metrics (`progress`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use dflash_models::Trainer;
use dflash_proto as pb;
use dflash_role::{KindExt, Session, StopCause};
use dflash_telemetry::ErrorKind;

use crate::pipeline::{Arrival, TrainedSet};
use crate::reporter::{Report, Reporter};

mod checkpoints;
mod evaluation;
mod lockstep;
mod progress;
mod replica;
mod resume;
mod step;

use checkpoints::{Retry, Writing};
pub use evaluation::PeriodicEval;
pub use lockstep::GroupMember;
use progress::{ProgressLog, export_step_metrics};
pub use replica::{ReplicaStep, follow_member};
pub use step::{Agreement, ReplicaOutcome, ReplicaReport};

/// The leader's training: takes each step's reports from the replicas,
/// accounts for their batches, and hands on (progress to the log and the
/// [`Reporter`], checkpoints on the interval, on SIGTERM and at the end,
/// evaluation on its interval).
pub struct TrainLoop {
    trainer: Trainer,
    session: Arc<Session>,
    rt: tokio::runtime::Handle,
    checkpoint_dir: PathBuf,
    /// For logging how full the HS queue is.
    hs_queue: flume::Sender<Arrival>,
    /// Held-out acceptance-length evaluation, when configured.
    eval: Option<PeriodicEval>,
    /// Delivers progress, checkpoints and errors to the coordinator.
    reporter: Reporter,
    /// Every batch trained in this checkpoint lineage, in order.
    trained: Vec<u64>,
    /// The same ids as a set, shared with the replicas (duplicate check).
    trained_set: TrainedSet,
    /// A failed checkpoint write to try again, and when.
    checkpoint_retry: Option<Retry>,
    last_checkpoint_step: u64,
    /// How many of `trained` the last checkpoint holds.
    checkpointed: usize,
    /// The checkpoint being written while training goes on (at most one).
    writing: Option<Writing>,
    /// The host memory of the last snapshot, for the next (pinned on a
    /// GPU; `None` while a write holds it).
    snapshot_buffers: Option<dflash_models::checkpoint::SnapshotBuffers>,
    bad_in_a_row: u32,
    log: ProgressLog,
}

/// One step as the replicas took it: every replica's report.
struct TakenStep {
    reports: Vec<ReplicaReport>,
    /// The leader's compute time in the step.
    seconds: f64,
}

/// What one step did, once its batches are accounted for.
struct StepResult {
    /// The figures of the first replica that trained (None: nothing trained).
    metrics: Option<dflash_models::StepMetrics>,
    tokens: u64,
    batches: Vec<pb::TrainedBatch>,
    /// Why each skipped batch was skipped, and the kind that counts it.
    skipped: Vec<(String, ErrorKind)>,
}

impl TrainLoop {
    pub fn new(
        trainer: Trainer,
        session: Arc<Session>,
        rt: tokio::runtime::Handle,
        hs_queue: flume::Sender<Arrival>,
        eval: Option<PeriodicEval>,
        reporter: Reporter,
    ) -> Self {
        let checkpoint_dir = PathBuf::from(&session.config.checkpoint.dir);
        Self {
            trainer,
            session,
            rt,
            checkpoint_dir,
            hs_queue,
            eval,
            reporter,
            trained: Vec::new(),
            trained_set: TrainedSet::default(),
            checkpoint_retry: None,
            last_checkpoint_step: 0,
            checkpointed: 0,
            writing: None,
            snapshot_buffers: None,
            bad_in_a_row: 0,
            log: ProgressLog::new(),
        }
    }

    pub fn trainer(&self) -> &Trainer {
        &self.trainer
    }

    /// The batches trained in this lineage, shared with the replicas.
    pub fn trained_set(&self) -> TrainedSet {
        self.trained_set.clone()
    }

    /// Trains until every batch is trained or the role stops. This thread
    /// is rank 0 (the leader: it reports, logs and checkpoints); the other
    /// ranks run [`follow_member`], and their outcomes of each step reach
    /// this one through the collective.
    pub fn run(mut self, mut replica: ReplicaStep) -> anyhow::Result<()> {
        let trained = self.train(&mut replica);
        // A checkpoint being written is finished and reported, whatever
        // ended training (a lost peer too): its steps are then not redone.
        let written = self.finish_write(true);
        trained?;
        written?;
        // Stopped: a signal (SIGTERM from Kubernetes, Ctrl-C) checkpoints
        // first so that no trained step is lost.
        if matches!(self.session.stop.cause(), Some(StopCause::Signal(_))) && self.trained.len() > self.checkpointed {
            tracing::info!("checkpointing step {} before exit", self.trainer.step());
            self.checkpoint()?;
            self.finish_write(true)?;
        }
        Ok(())
    }

    fn train(&mut self, replica: &mut ReplicaStep) -> anyhow::Result<()> {
        let stop = self.session.stop.clone();
        loop {
            match self.take_step(replica, &stop)? {
                Taken::Stopping => return Ok(()),
                // No batch now: catch up on what failed before.
                Taken::Nothing => {}
                Taken::Step(taken) => {
                    let result = self.account(taken.reports)?;
                    self.hand_on(result, taken.seconds)?;
                }
            }
            self.catch_up()?;
        }
    }

    /// Takes one lockstep step, and every replica's report of it.
    fn take_step(&mut self, replica: &mut ReplicaStep, stop: &dflash_role::Stop) -> anyhow::Result<Taken> {
        let wait_start = Instant::now();
        let (own, flags) = replica.step(&mut self.trainer, stop)?;
        let seconds = own.busy.as_secs_f64();
        self.log.waited(wait_start.elapsed().saturating_sub(own.busy));
        if flags.stopping {
            return Ok(Taken::Stopping);
        }
        if !flags.any_batch {
            return Ok(Taken::Nothing);
        }
        // Exactly one report per rank for every step anyone took: the other
        // ranks' came with the step's collective.
        let mut reports = vec![own];
        if let Some(m) = replica.group_member.as_mut() {
            reports.extend(m.take_gathered());
        }
        if reports.len() != replica.world() {
            anyhow::bail!("step gathered {} report(s) from a group of {} rank(s)", reports.len(), replica.world());
        }
        Ok(Taken::Step(TakenStep { reports, seconds }))
    }

    /// Records what each replica did with its batch; too many bad batches
    /// in a row fail the run.
    fn account(&mut self, reports: Vec<ReplicaReport>) -> anyhow::Result<StepResult> {
        let mut r = StepResult { metrics: None, tokens: 0, batches: Vec::new(), skipped: Vec::new() };
        for report in reports {
            let Some(id) = report.batch_id else { continue };
            let member = report.member.clone();
            let entry = |id, skip_reason: Option<&String>| pb::TrainedBatch {
                batch_id: id,
                skipped: skip_reason.is_some(),
                skip_reason: skip_reason.cloned().unwrap_or_default(),
                member: member.clone(),
            };
            let done = |id| entry(id, None);
            match report.outcome {
                ReplicaOutcome::Duplicate => {
                    tracing::info!("batch {id} was already trained; not training it again");
                    dflash_telemetry::metrics().batches.with_label_values(&["duplicate"]).inc();
                    r.batches.push(done(id));
                }
                ReplicaOutcome::Trained(m) => {
                    self.record(id);
                    r.batches.push(done(id));
                    r.tokens += m.tokens;
                    r.metrics.get_or_insert(m);
                }
                ReplicaOutcome::Skipped(reason) => {
                    self.record(id);
                    r.batches.push(entry(id, Some(&reason)));
                    dflash_telemetry::metrics().batches.with_label_values(&["skipped"]).inc();
                    dflash_telemetry::metrics().errors.with_label_values(&["non_finite"]).inc();
                    r.skipped.push((reason, ErrorKind::NonFinite));
                }
                ReplicaOutcome::Rejected(reason) => {
                    self.record(id);
                    r.batches.push(entry(id, Some(&reason)));
                    r.skipped.push((reason, ErrorKind::BadBatch));
                }
            }
        }
        if r.metrics.is_some() {
            self.bad_in_a_row = 0;
        }
        for (reason, kind) in &r.skipped {
            self.count_bad(reason, *kind)?;
        }
        Ok(r)
    }

    /// The step's log line and metrics, its report, and the checkpoint and
    /// evaluation when their interval comes.
    fn hand_on(&mut self, r: StepResult, seconds: f64) -> anyhow::Result<()> {
        let c = &self.session.config;
        let step = self.trainer.step();
        self.log.tokens += r.tokens;
        if let Some(m) = &r.metrics {
            self.log.step(c, step, m, self.hs_queue.len());
        }
        export_step_metrics(step, r.metrics.as_ref(), r.tokens, self.log.input_wait, self.hs_queue.len(), seconds);
        let trained_something = r.metrics.is_some();
        self.reporter.send(Report::Step {
            step,
            batches: r.batches,
            metrics: r.metrics,
            tokens: r.tokens,
            input_wait: self.log.input_wait,
        });
        let writing_it = self.writing.as_ref().is_some_and(|w| w.step == step);
        if step > 0
            && step.is_multiple_of(c.checkpoint.interval_steps)
            && step != self.last_checkpoint_step
            && !writing_it
        {
            self.checkpoint()?;
        }
        self.evaluate_on_interval(step, trained_something);
        Ok(())
    }

    /// What is owed when no batch comes (or the run is trained): a
    /// checkpoint write to retry, and, once every batch is trained, the
    /// final checkpoint.
    fn catch_up(&mut self) -> anyhow::Result<()> {
        self.finish_write(false)?;
        let retry_due = self.checkpoint_retry.as_ref().is_some_and(Retry::due);
        let final_due = self.reporter.all_trained()
            && self.trained.len() > self.checkpointed
            && self.checkpoint_retry.is_none()
            && self.writing.is_none();
        if retry_due || final_due {
            if final_due {
                self.evaluate_final();
                tracing::info!("every batch of the run is trained: final checkpoint");
            }
            self.checkpoint()?;
        }
        Ok(())
    }

    /// One more bad batch in a row; too many fail the run.
    fn count_bad(&mut self, reason: &str, kind: ErrorKind) -> anyhow::Result<()> {
        self.bad_in_a_row += 1;
        let max = self.session.config.training.max_bad_batches_in_a_row;
        tracing::warn!("skipped {reason} ({} in a row)", self.bad_in_a_row);
        if self.bad_in_a_row >= max {
            return Err(anyhow::anyhow!(
                "{} batches in a row could not be trained (last: {reason}); training.max_bad_batches_in_a_row = {max}",
                self.bad_in_a_row
            ))
            .kind(kind);
        }
        Ok(())
    }

    fn record(&mut self, id: u64) {
        self.trained.push(id);
        self.trained_set.insert(id);
    }
}

/// What one call of [`TrainLoop::take_step`] found.
enum Taken {
    Stopping,
    Nothing,
    Step(TakenStep),
}
