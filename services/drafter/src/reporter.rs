//! The drafter's reports to the coordinator, off the training thread: the
//! train loop hands each step's batches, each checkpoint and each error to
//! a bounded queue and goes on; this task delivers them in order (trained
//! batches before the checkpoint that holds them, so a checkpoint commits
//! only what the ledger knows is trained), keeps what the coordinator did
//! not receive (it restarted, the network dropped) and sends it again with
//! backoff, also when no batch comes any more. A refusal the written
//! policy calls final fails the role.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use dflash_models::StepMetrics;
use dflash_models::checkpoint::Checkpoint;
use dflash_proto as pb;
use dflash_role::{KindExt, Session, with_timeout};
use dflash_telemetry::{ErrorKind, Reaction};

/// Reports waiting between the train loop and this task. The task drains
/// the queue while it waits to retry, so only a coordinator RPC in flight
/// (bounded by the RPC timeout) can fill it; then the train loop waits.
const QUEUE: usize = 256;

/// One thing the coordinator must hear of.
pub enum Report {
    /// One step: the batches it trained, skipped or found already trained.
    Step { step: u64, batches: Vec<pb::TrainedBatch>, metrics: Option<StepMetrics>, tokens: u64, input_wait: f32 },
    /// A checkpoint on disk and every batch of its lineage.
    Checkpoint { checkpoint: Checkpoint, batch_ids: Vec<u64> },
    /// An error for the run's error log (best effort).
    Error { kind: ErrorKind, error: anyhow::Error },
}

/// The train loop's end of the reports.
pub struct Reporter {
    tx: flume::Sender<Report>,
    all_trained: Arc<AtomicBool>,
}

impl Reporter {
    /// The reporter and the task that delivers its reports; the task ends
    /// once the reporter is dropped and what it owes is delivered (or the
    /// coordinator stays unreachable for an RPC timeout).
    pub fn start(session: Arc<Session>) -> (Self, impl Future<Output = anyhow::Result<()>> + Send + 'static) {
        let (tx, rx) = flume::bounded(QUEUE);
        let all_trained = Arc::new(AtomicBool::new(false));
        let delivery = Delivery { session, rx, owed: Owed::default(), all_trained: Arc::clone(&all_trained) };
        (Self { tx, all_trained }, delivery.run())
    }

    /// Queues a report; waits only while the queue is full.
    pub fn send(&self, r: Report) {
        // The delivery task ends only after this side is dropped (or is
        // aborted at shutdown, when nothing is delivered any more anyway).
        let _ = self.tx.send(r);
    }

    /// The coordinator said every batch of the run is trained.
    pub fn all_trained(&self) -> bool {
        self.all_trained.load(Ordering::Acquire)
    }

    /// Reports queued or not yet taken by the coordinator.
    pub fn backlog(&self) -> usize {
        self.tx.len()
    }
}

/// What the coordinator has not taken yet, merged: every step's batches
/// in order with the latest figures, and the newest checkpoint.
#[derive(Default)]
struct Owed {
    step: u64,
    batches: Vec<pb::TrainedBatch>,
    metrics: Option<StepMetrics>,
    tokens: u64,
    input_wait: f32,
    /// Whether a step is owed even without batches (its figures).
    step_owed: bool,
    checkpoint: Option<(Checkpoint, Vec<u64>)>,
    errors: Vec<(ErrorKind, anyhow::Error)>,
}

/// Errors kept for the coordinator while it is unreachable (the newest).
const MAX_OWED_ERRORS: usize = 32;

impl Owed {
    fn add(&mut self, r: Report) {
        match r {
            Report::Step { step, batches, metrics, tokens, input_wait } => {
                self.step = step;
                self.batches.extend(batches);
                if metrics.is_some() {
                    self.metrics = metrics;
                }
                self.tokens += tokens;
                self.input_wait = input_wait;
                self.step_owed = true;
            }
            Report::Checkpoint { checkpoint, batch_ids } => self.checkpoint = Some((checkpoint, batch_ids)),
            Report::Error { kind, error } => {
                if self.errors.len() == MAX_OWED_ERRORS {
                    self.errors.remove(0);
                }
                self.errors.push((kind, error));
            }
        }
    }

    fn is_empty(&self) -> bool {
        !self.step_owed && self.checkpoint.is_none() && self.errors.is_empty()
    }
}

/// How one delivery attempt ended.
enum Delivered {
    All,
    /// The coordinator could not be reached: the rest stays owed.
    NotYet,
}

struct Delivery {
    session: Arc<Session>,
    rx: flume::Receiver<Report>,
    owed: Owed,
    all_trained: Arc<AtomicBool>,
}

impl Delivery {
    async fn run(mut self) -> anyhow::Result<()> {
        let mut backoff = dflash_role::Backoff::new();
        let mut retry_at: Option<tokio::time::Instant> = None;
        loop {
            let due = retry_at.is_none_or(|t| tokio::time::Instant::now() >= t);
            if !self.owed.is_empty() && due {
                match self.deliver().await? {
                    Delivered::All => {
                        backoff.reset();
                        retry_at = None;
                    }
                    Delivered::NotYet => {
                        let d = backoff.next_delay();
                        tracing::debug!("the coordinator did not take the reports; again in {d:?}");
                        retry_at = Some(tokio::time::Instant::now() + d);
                    }
                }
            }
            let wait = retry_at.filter(|_| !self.owed.is_empty());
            let next = match wait {
                Some(t) => tokio::select! {
                    r = self.rx.recv_async() => Some(r),
                    _ = tokio::time::sleep_until(t) => None,
                },
                None => Some(self.rx.recv_async().await),
            };
            match next {
                Some(Ok(r)) => {
                    self.owed.add(r);
                    // Everything queued now goes into the same delivery.
                    while let Ok(r) = self.rx.try_recv() {
                        self.owed.add(r);
                    }
                }
                Some(Err(_)) => return self.last_delivery().await,
                None => {}
            }
        }
    }

    /// The train loop is done: what it still owes (its last checkpoint,
    /// say, after SIGTERM) gets attempts for one RPC timeout.
    async fn last_delivery(mut self) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + self.session.rpc_timeout();
        let mut backoff = dflash_role::Backoff::new();
        while !self.owed.is_empty() {
            if let Delivered::All = self.deliver().await? {
                return Ok(());
            }
            let d = backoff.next_delay();
            if tokio::time::Instant::now() + d >= deadline {
                tracing::warn!(
                    "the coordinator did not take the last reports ({} batch(es){}); a later drafter resumes from \
                     what is on disk",
                    self.owed.batches.len(),
                    if self.owed.checkpoint.is_some() { " and a checkpoint" } else { "" }
                );
                return Ok(());
            }
            tokio::time::sleep(d).await;
        }
        Ok(())
    }

    /// Sends what is owed, in order: errors, trained batches, the checkpoint.
    async fn deliver(&mut self) -> anyhow::Result<Delivered> {
        for (kind, error) in std::mem::take(&mut self.owed.errors) {
            self.session.report_error(kind, &error).await;
        }
        if self.owed.step_owed {
            let o = &self.owed;
            let m = o.metrics.clone().unwrap_or_default();
            let req = pb::ReportTrainedRequest {
                run_id: self.session.run_id.clone(),
                instance_id: self.session.instance_id.clone(),
                step: o.step,
                batches: o.batches.clone(),
                loss: m.loss as f32,
                accuracy: m.accuracy as f32,
                acceptance_length: m.acceptance_length as f32,
                tokens: o.tokens,
                input_wait_fraction: o.input_wait,
            };
            match with_timeout(self.session.rpc_timeout(), self.session.client().report_trained(req)).await {
                Ok(r) => {
                    let o = &mut self.owed;
                    (o.batches, o.metrics, o.tokens, o.step_owed) = (Vec::new(), None, 0, false);
                    if r.all_trained {
                        self.all_trained.store(true, Ordering::Release);
                    }
                }
                Err(s) => return self.not_taken("progress", &s),
            }
        }
        if let Some((ck, batch_ids)) = self.owed.checkpoint.clone() {
            let req = pb::ReportCheckpointRequest {
                run_id: self.session.run_id.clone(),
                instance_id: self.session.instance_id.clone(),
                step: ck.step,
                path: ck.dir.display().to_string(),
                batch_ids,
                resumed: false,
                content_hash: ck.content_hash.clone(),
            };
            match with_timeout(self.session.rpc_timeout(), self.session.client().report_checkpoint(req)).await {
                Ok(_) => self.owed.checkpoint = None,
                // The checkpoint is on disk; the report is sent again.
                Err(s) => return self.not_taken(&format!("checkpoint {}", ck.dir.display()), &s),
            }
        }
        Ok(Delivered::All)
    }

    /// A report the coordinator did not take: kept when a retry can help,
    /// the role's failure when the written policy says none can.
    fn not_taken(&self, what: &str, s: &tonic::Status) -> anyhow::Result<Delivered> {
        let e = dflash_proto::CoordinatorError::from_status(s);
        if dflash_telemetry::on_coordinator_error(e.as_ref()) == Reaction::Rejoin {
            // Its generation ended: what it trained since the last commit
            // is redone by the next one, which this drafter joins.
            self.session.stop.stop(dflash_role::StopCause::GroupReform(format!("the {what} report: {}", s.message())));
            return Ok(Delivered::NotYet);
        }
        if dflash_telemetry::on_coordinator_error(e.as_ref()) == Reaction::Fail {
            return Err(anyhow::anyhow!("coordinator refused the {what} report: {}", s.message()))
                .kind(ErrorKind::Protocol);
        }
        tracing::warn!("could not report {what} ({}); will retry", s.message());
        Ok(Delivered::NotYet)
    }
}
