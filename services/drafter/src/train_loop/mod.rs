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

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use backon::BackoffBuilder;
use dflash_models::checkpoint::{
    Checkpoint, CheckpointSnapshot, TrainerState, check_writable, point_latest, read_trainer_state,
    remove_stale_temporaries, restore_checkpoint, set_aside, step_dirs, verify_checkpoint,
};
use dflash_models::collective::Collective;
use dflash_models::{ModelError, StepOutcome, Trainer};
use dflash_proto as pb;
use dflash_role::{KindExt, Session, StopCause, with_timeout};
use dflash_telemetry::ErrorKind;

use crate::periodic_eval::PeriodicEval;
use crate::pipeline::{Arrival, Prepared, TrainedSet};
use crate::reporter::{Report, Reporter};

/// What happened to one replica's batch in one step.
pub enum ReplicaOutcome {
    Trained(dflash_models::StepMetrics),
    /// Not finite (features, loss or gradients): the weights are untouched.
    Skipped(String),
    /// The receiver rejected the plan's batch (bad contents).
    Rejected(String),
    /// Already trained in this lineage (a replay whose ack was lost).
    Duplicate,
}

/// One replica's part of one step.
pub struct ReplicaReport {
    pub batch_id: Option<u64>,
    /// The drafter instance (group member) the replica runs in.
    pub member: String,
    pub outcome: ReplicaOutcome,
    /// Time spent computing (not waiting for a batch).
    pub busy: Duration,
}

/// What all replicas agreed on for one step.
pub struct Agreement {
    pub any_batch: bool,
    pub stopping: bool,
}

/// How long a replica waits for its next batch before it takes an idle
/// step: the cadence at which idle replicas agree with each other (ready,
/// stopping) and the leader retries what failed (a checkpoint write). A
/// stop wakes the wait at once.
const IDLE_TICK: Duration = Duration::from_millis(100);

/// What a replica's wait for its next batch brought.
enum Next {
    Batch(Prepared),
    /// Nothing within [`IDLE_TICK`], or the role stopped.
    Idle,
    /// Prefetch is gone: no batch will come.
    Closed,
}

fn next_prepared(input: &flume::Receiver<Prepared>, stop: &dflash_role::Stop) -> Next {
    if stop.is_stopped() {
        return Next::Idle;
    }
    flume::Selector::new()
        .recv(input, |r| r.map_or(Next::Closed, Next::Batch))
        .recv(stop.channel(), |_| Next::Idle)
        .wait_timeout(IDLE_TICK)
        .unwrap_or(Next::Idle)
}

/// One replica's side of the lockstep: take a batch if one comes within a
/// short wait, compute its gradients, agree with the other replicas on who
/// contributes and whether to stop, average gradients, step. Every replica
/// takes the same optimizer steps, so their weights stay identical.
pub struct ReplicaStep {
    pub input: flume::Receiver<Prepared>,
    pub group: Option<Box<dyn Collective>>,
    pub trained: TrainedSet,
    pub device: tch::Device,
    /// Verify every this many steps that the replicas hold identical weights.
    pub check_every: u64,
    /// This process's instance id (the member its replicas belong to).
    pub member: String,
    /// Set with `group` (a group of several ranks): see [`GroupMember`].
    pub group_member: Option<GroupMember>,
}

/// A rank of a drafter group of several ranks (replicas of this member,
/// of others, or both). It steps only when every rank holds its next batch
/// in the plan's order (or has none left), so that step k trains the k-th
/// batch dealt to each rank whatever the timing; and it learns the others'
/// outcomes through the collective (rank 0 reports them all).
#[derive(Default)]
pub struct GroupMember {
    /// Instance id of each rank.
    pub names: Vec<String>,
    held: Option<Prepared>,
    exhausted: bool,
    /// The other ranks' reports of the last step.
    gathered: Vec<ReplicaReport>,
}

/// Per rank in the gathered reports: batch id + 1 (0: none), outcome,
/// loss, accuracy, acceptance length, tokens.
const GATHERED: usize = 6;

impl GroupMember {
    pub fn new(names: Vec<String>) -> Self {
        Self { names, ..Self::default() }
    }

    /// The other ranks' reports of the step just taken.
    pub fn take_gathered(&mut self) -> Vec<ReplicaReport> {
        std::mem::take(&mut self.gathered)
    }
}

impl ReplicaStep {
    pub fn world(&self) -> usize {
        self.group.as_ref().map_or(1, |g| g.world())
    }

    pub fn step(
        &mut self,
        trainer: &mut dflash_models::Trainer,
        stop: &dflash_role::Stop,
    ) -> anyhow::Result<(ReplicaReport, Agreement)> {
        if self.group_member.is_some() {
            return self.member_step(trainer, stop);
        }
        let prepared = match next_prepared(&self.input, stop) {
            Next::Batch(p) => Some(p),
            Next::Idle | Next::Closed => None,
        };
        self.train_step(trainer, prepared, stop)
    }

    /// A group rank's step: first every rank says whether it is ready.
    fn member_step(
        &mut self,
        trainer: &mut dflash_models::Trainer,
        stop: &dflash_role::Stop,
    ) -> anyhow::Result<(ReplicaReport, Agreement)> {
        let m = self.group_member.as_mut().expect("a group member");
        if m.held.is_none() && !m.exhausted {
            match next_prepared(&self.input, stop) {
                Next::Batch(p) => m.held = Some(p),
                Next::Closed => m.exhausted = true,
                Next::Idle => {}
            }
        }
        let g = self.group.as_ref().expect("a group member has a collective");
        let flags = [
            f64::from(u8::from(m.held.is_some() || m.exhausted)),
            f64::from(u8::from(stop.is_stopped())),
            f64::from(u8::from(m.held.is_some())),
        ];
        // Rank 0 may pause between steps (evaluating, snapshotting a
        // checkpoint): this wait ends when the others are ready or the
        // generation ends, not after the collective timeout (where the
        // collective can be cancelled: NCCL).
        let a = g.agree_between_steps(&flags, self.device).kind(ErrorKind::PeerLost)?;
        let idle = ReplicaReport {
            batch_id: None,
            member: self.member.clone(),
            outcome: ReplicaOutcome::Duplicate,
            busy: Duration::ZERO,
        };
        if a[1] > 0.0 {
            return Ok((idle, Agreement { any_batch: false, stopping: true }));
        }
        if a[0] < g.world() as f64 || a[2] == 0.0 {
            return Ok((idle, Agreement { any_batch: false, stopping: false }));
        }
        let prepared = m.held.take();
        let (report, agreement) = self.train_step(trainer, prepared, stop)?;
        self.gather(&report, trainer.step())?;
        Ok((report, agreement))
    }

    /// Shares every rank's outcome of the step with every rank.
    fn gather(&mut self, own: &ReplicaReport, step: u64) -> anyhow::Result<()> {
        let g = self.group.as_ref().expect("a group member has a collective");
        let (rank, world) = (g.rank(), g.world());
        let mut v = vec![0f64; world * GATHERED];
        let slot = &mut v[rank * GATHERED..(rank + 1) * GATHERED];
        slot[0] = own.batch_id.map_or(0.0, |id| id as f64 + 1.0);
        slot[1] = match &own.outcome {
            ReplicaOutcome::Trained(m) => {
                (slot[2], slot[3], slot[4], slot[5]) = (m.loss, m.accuracy, m.acceptance_length, m.tokens as f64);
                1.0
            }
            ReplicaOutcome::Skipped(_) => 2.0,
            ReplicaOutcome::Rejected(_) => 3.0,
            ReplicaOutcome::Duplicate => 4.0,
        };
        let all = g.agree(&v, self.device).kind(ErrorKind::PeerLost)?;
        let m = self.group_member.as_mut().expect("a group member");
        m.gathered = (0..world)
            .filter(|&r| r != rank)
            .map(|r| {
                let s = &all[r * GATHERED..(r + 1) * GATHERED];
                let outcome = match s[1] as u8 {
                    1 => ReplicaOutcome::Trained(dflash_models::StepMetrics {
                        step,
                        loss: s[2],
                        accuracy: s[3],
                        acceptance_length: s[4],
                        tokens: s[5] as u64,
                        ..Default::default()
                    }),
                    2 => ReplicaOutcome::Skipped(format!("not finite on rank {r}")),
                    3 => ReplicaOutcome::Rejected(format!("rejected by rank {r}")),
                    _ => ReplicaOutcome::Duplicate,
                };
                ReplicaReport {
                    batch_id: (s[0] > 0.0).then(|| s[0] as u64 - 1),
                    member: m.names.get(r).cloned().unwrap_or_default(),
                    outcome,
                    busy: Duration::ZERO,
                }
            })
            .collect();
        Ok(())
    }

    /// Trains `prepared` (if any) in lockstep with the other replicas.
    fn train_step(
        &mut self,
        trainer: &mut dflash_models::Trainer,
        prepared: Option<Prepared>,
        stop: &dflash_role::Stop,
    ) -> anyhow::Result<(ReplicaReport, Agreement)> {
        let (batch, rejected) = match prepared {
            Some(Prepared::Batch(b)) => (Some(b), None),
            Some(Prepared::Rejected(r)) => (None, Some(r)),
            None => (None, None),
        };
        let t0 = Instant::now();
        let span = batch.as_ref().map(|b| dflash_telemetry::batch_span("train_step", &b.trace_context, b.batch_id));
        let _entered = span.as_ref().map(tracing::Span::enter);
        let mut report = ReplicaReport {
            batch_id: batch.as_ref().map(|b| b.batch_id).or(rejected.as_ref().map(|r| r.batch_id)),
            member: self.member.clone(),
            outcome: ReplicaOutcome::Duplicate,
            busy: Duration::ZERO,
        };
        if let Some(r) = rejected {
            report.outcome = ReplicaOutcome::Rejected(r.skip_reason);
        }
        let mut contributes = false;
        let mut pending = None;
        if let Some(b) = &batch {
            let dup = self.trained.contains(b.batch_id);
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
            f64::from(u8::from(contributes)),
            f64::from(u8::from(report.batch_id.is_some())),
            f64::from(u8::from(stop.is_stopped())),
        ];
        let agreed = match &self.group {
            Some(g) => g.agree(&flags, self.device).kind(ErrorKind::Device)?,
            None => flags.to_vec(),
        };
        let agreement = Agreement { any_batch: agreed[1] > 0.0, stopping: agreed[2] > 0.0 };
        if !agreement.stopping && agreed[0] > 0.0 {
            if let Some(g) = &self.group {
                g.average_gradients(&trainer.drafter().named_parameters(), agreed[0]).kind(ErrorKind::Device)?;
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
                    g.check_identical(&trainer.drafter().named_parameters(), self.device).kind(ErrorKind::Device)?;
                if g.rank() == 0 {
                    tracing::info!(
                        "step {}: weights identical on all {} replicas (checksum {sum:.6e})",
                        trainer.step(),
                        g.world()
                    );
                }
            }
        }
        report.busy = t0.elapsed();
        Ok((report, agreement))
    }
}

/// A rank other than 0 (another replica of this member, or of another
/// member): steps in lockstep and keeps its own record of what it trained
/// (replays are not trained twice); rank 0 learns its outcomes through the
/// collective and reports them.
pub fn follow_member(
    mut trainer: dflash_models::Trainer,
    mut replica: ReplicaStep,
    stop: dflash_role::Stop,
) -> anyhow::Result<()> {
    loop {
        let (report, flags) = replica.step(&mut trainer, &stop)?;
        if flags.stopping {
            return Ok(());
        }
        if let Some(id) = report.batch_id
            && !matches!(report.outcome, ReplicaOutcome::Duplicate)
        {
            replica.trained.insert(id);
        }
    }
}

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
    bad_in_a_row: u32,
    log: ProgressLog,
}

/// A checkpoint written on its own thread (`checkpoint.async_write`) from
/// a host snapshot, while the trainer steps on.
struct Writing {
    step: u64,
    /// How many of `trained` it holds.
    trained: usize,
    batch_ids: Vec<u64>,
    started: Instant,
    /// How long taking the snapshot paused training.
    paused: Duration,
    done: flume::Receiver<Result<Checkpoint, ModelError>>,
    thread: std::thread::JoinHandle<()>,
}

/// How often a wait for a checkpoint write says it is still waiting.
const WRITE_WAIT_NOTICE: Duration = Duration::from_secs(30);

/// The next attempt of something that failed, with exponential backoff.
struct Retry {
    at: Instant,
    delays: backon::ExponentialBackoff,
}

impl Retry {
    fn new() -> Self {
        Self { at: Instant::now(), delays: Self::delays() }
    }

    fn delays() -> backon::ExponentialBackoff {
        backon::ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(500))
            .with_max_delay(Duration::from_secs(30))
            .with_jitter()
            .without_max_times()
            .build()
    }

    fn due(&self) -> bool {
        Instant::now() >= self.at
    }

    /// Schedules the next attempt; returns its delay.
    fn failed(&mut self) -> Duration {
        let d = self.delays.next().unwrap_or(Duration::from_secs(30));
        self.at = Instant::now() + d;
        d
    }
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

/// Throughput and input wait over the window of the log line.
struct ProgressLog {
    started: Instant,
    tokens: u64,
    wait: Duration,
    /// Fraction of the current window spent waiting for input.
    input_wait: f32,
    /// No step logged by this process yet: a resumed drafter logs its first.
    first: bool,
}

impl ProgressLog {
    fn new() -> Self {
        Self { started: Instant::now(), tokens: 0, wait: Duration::ZERO, input_wait: 0.0, first: true }
    }

    fn waited(&mut self, d: Duration) {
        self.wait += d;
        let secs = self.started.elapsed().as_secs_f64().max(1e-9);
        self.input_wait = (self.wait.as_secs_f64() / secs) as f32;
    }

    /// Whether `step` gets a line: every `every` steps, and this process's first.
    fn due(&mut self, step: u64, every: u64) -> bool {
        std::mem::take(&mut self.first) || step.is_multiple_of(every.max(1))
    }

    /// The step's line every `log_every_steps` (and this process's first
    /// step, so a resume shows when training went on); a new window after it.
    fn step(&mut self, c: &dflash_config::RunConfig, step: u64, m: &dflash_models::StepMetrics, queue: usize) {
        if !self.due(step, c.run.log_every_steps) {
            return;
        }
        let secs = self.started.elapsed().as_secs_f64();
        // DFlash2: how often the label is among the selector's candidates
        // (this process's micro-batches).
        let recall = m.candidate_recall.map_or_else(String::new, |r| format!(" | recall {r:.3}"));
        tracing::info!(
            "step {step}/{} | loss {:.4} | acc {:.3} | accept {:.2}{recall} | lr {:.2e} | grad {:.2} | {:.0} tok/s | queue {}/{} | wait {:.0}%",
            c.training.total_steps,
            m.loss,
            m.accuracy,
            m.acceptance_length,
            m.lr,
            m.grad_norm,
            self.tokens as f64 / secs,
            queue,
            c.pipeline.hs_queue_depth,
            100.0 * self.wait.as_secs_f64() / secs
        );
        *self = Self { input_wait: self.input_wait, first: false, ..Self::new() };
    }
}

/// Why a checkpoint directory cannot be resumed from.
struct NotResumable(String);

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
            let done = |id| pb::TrainedBatch {
                batch_id: id,
                skipped: false,
                skip_reason: String::new(),
                member: member.clone(),
            };
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
                    r.batches.push(pb::TrainedBatch {
                        batch_id: id,
                        skipped: true,
                        skip_reason: reason.clone(),
                        member: member.clone(),
                    });
                    dflash_telemetry::metrics().batches.with_label_values(&["skipped"]).inc();
                    dflash_telemetry::metrics().errors.with_label_values(&["non_finite"]).inc();
                    r.skipped.push((reason, ErrorKind::NonFinite));
                }
                ReplicaOutcome::Rejected(reason) => {
                    self.record(id);
                    r.batches.push(pb::TrainedBatch {
                        batch_id: id,
                        skipped: true,
                        skip_reason: reason.clone(),
                        member: member.clone(),
                    });
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
        if let Some(e) = &self.eval
            && trained_something
            && e.every > 0
            && step.is_multiple_of(e.every)
            && !self.reporter.all_trained()
        {
            e.run(step, &self.trainer);
        }
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
                if let Some(e) = self.eval.as_ref().filter(|e| e.every > 0) {
                    e.run(self.trainer.step(), &self.trainer);
                }
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

    /// Takes a checkpoint: a host snapshot of the trainer (the only part
    /// that pauses training), then its write, on a thread of its own with
    /// `checkpoint.async_write`, else here. Its report goes on once it is
    /// durable. A failed write (a full disk) is not fatal: the last good
    /// checkpoint stays, the coordinator hears of the failure, and the
    /// write is tried again with backoff.
    fn checkpoint(&mut self) -> anyhow::Result<()> {
        // One write at a time: a checkpoint due while the last one is still
        // being written waits for it (bounding the snapshots held to one).
        self.finish_write(true)?;
        let started = Instant::now();
        let state = TrainerState {
            step: self.trainer.step(),
            batch_ids: self.trained.clone(),
            run_config: self.session.config_toml(),
            run_id: self.session.run_id.clone(),
        };
        let (step, trained, batch_ids) = (state.step, self.trained.len(), state.batch_ids.clone());
        let snapshot = match CheckpointSnapshot::take(&self.trainer, state) {
            Ok(s) => s,
            Err(e) => {
                self.written(step, trained, batch_ids, (started, started.elapsed()), Err(e));
                return Ok(());
            }
        };
        let paused = started.elapsed();
        let keep = self.session.config.checkpoint.keep_last as usize;
        let root = self.checkpoint_dir.clone();
        if !self.session.config.checkpoint.async_write {
            let r = snapshot.save(&root, keep);
            self.written(step, trained, batch_ids, (started, started.elapsed()), r);
            return Ok(());
        }
        tracing::debug!("checkpoint of step {step}: {} MiB snapshot on the host", snapshot.bytes() >> 20);
        let (tx, done) = flume::bounded(1);
        let thread = std::thread::Builder::new()
            .name("checkpoint-write".into())
            .spawn(move || {
                let _ = tx.send(snapshot.save(&root, keep));
            })
            .context("starting the checkpoint writer thread")?;
        self.writing = Some(Writing { step, trained, batch_ids, started, paused, done, thread });
        Ok(())
    }

    /// Hands on the checkpoint being written once its write is over; with
    /// `wait`, waits for it (saying so every [`WRITE_WAIT_NOTICE`]).
    fn finish_write(&mut self, wait: bool) -> anyhow::Result<()> {
        let Some(w) = self.writing.as_ref() else { return Ok(()) };
        let result = loop {
            match w.done.recv_timeout(if wait { WRITE_WAIT_NOTICE } else { Duration::ZERO }) {
                Ok(r) => break r,
                Err(flume::RecvTimeoutError::Timeout) if wait => tracing::warn!(
                    "still writing the checkpoint of step {} after {:.0} s (training waits for it)",
                    w.step,
                    w.started.elapsed().as_secs_f64()
                ),
                Err(flume::RecvTimeoutError::Timeout) => return Ok(()),
                Err(flume::RecvTimeoutError::Disconnected) => {
                    break Err(ModelError::Checkpoint("the checkpoint writer thread ended without a result".into()));
                }
            }
        };
        let w = self.writing.take().expect("a write in flight");
        if w.thread.join().is_err() {
            anyhow::bail!("the checkpoint writer thread panicked");
        }
        self.written(w.step, w.trained, w.batch_ids, (w.started, w.paused), result);
        Ok(())
    }

    /// What a checkpoint write came to: its report, or a retry.
    /// `(started, paused)`: when it began and how long it paused training.
    fn written(
        &mut self,
        step: u64,
        trained: usize,
        batch_ids: Vec<u64>,
        (started, paused): (Instant, Duration),
        result: Result<Checkpoint, ModelError>,
    ) {
        match result {
            Ok(ck) => {
                self.checkpoint_retry = None;
                self.last_checkpoint_step = step;
                self.checkpointed = trained;
                tracing::info!(
                    "checkpoint {} written in {:.2} s, training paused {:.2} s for it (content {})",
                    ck.dir.display(),
                    started.elapsed().as_secs_f64(),
                    paused.as_secs_f64(),
                    short(&ck.content_hash)
                );
                let seconds = &dflash_telemetry::metrics().checkpoint_seconds;
                seconds.with_label_values(&["pause"]).observe(paused.as_secs_f64());
                seconds.with_label_values(&["write"]).observe(started.elapsed().as_secs_f64());
                self.reporter.send(Report::Checkpoint { checkpoint: ck, batch_ids });
            }
            Err(e) => {
                let retry = self.checkpoint_retry.get_or_insert_with(Retry::new);
                let delay = retry.failed();
                let err = anyhow::anyhow!(
                    "checkpoint of step {step} failed: {e}; training goes on, the last good checkpoint (step {}) \
                     stays, retrying in {:.1} s",
                    self.last_checkpoint_step,
                    delay.as_secs_f64()
                );
                tracing::error!("{err}");
                dflash_telemetry::metrics().errors.with_label_values(&[ErrorKind::CheckpointWrite.as_str()]).inc();
                self.reporter.send(Report::Error { kind: ErrorKind::CheckpointWrite, error: err });
            }
        }
    }
}

/// What one call of [`TrainLoop::take_step`] found.
enum Taken {
    Stopping,
    Nothing,
    Step(TakenStep),
}

/// Whether the coordinator refused a report for good (the written policy
/// says no retry helps); else it is sent again.
fn refused(s: &tonic::Status) -> bool {
    let e = dflash_proto::CoordinatorError::from_status(s);
    dflash_telemetry::on_coordinator_error(e.as_ref()) == dflash_telemetry::Reaction::Fail
}

/// The first hex digits of a hash, for messages.
fn short(hash: &str) -> &str {
    &hash[..hash.len().min(12)]
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

#[cfg(test)]
mod tests {
    use super::ProgressLog;

    #[test]
    fn a_process_logs_its_first_step_then_every_nth() {
        let mut log = ProgressLog::new();
        let logged: Vec<u64> = (41..=75).filter(|&s| log.due(s, 10)).collect();
        assert_eq!(logged, [41, 50, 60, 70]);
    }
}
