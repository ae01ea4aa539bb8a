//! One step's vocabulary, shared by the replica's step, the group's
//! lockstep and the leader that accounts for it: how a replica waits for
//! its next batch, what it reports of the step, and what the replicas agreed.

use std::time::Duration;

use crate::pipeline::Prepared;

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
pub(super) enum Next {
    Batch(Prepared),
    /// Nothing within [`IDLE_TICK`], or the role stopped.
    Idle,
    /// Prefetch is gone: no batch will come.
    Closed,
}

pub(super) fn next_prepared(input: &flume::Receiver<Prepared>, stop: &dflash_role::Stop) -> Next {
    if stop.is_stopped() {
        return Next::Idle;
    }
    flume::Selector::new()
        .recv(input, |r| r.map_or(Next::Closed, Next::Batch))
        .recv(stop.channel(), |_| Next::Idle)
        .wait_timeout(IDLE_TICK)
        .unwrap_or(Next::Idle)
}
