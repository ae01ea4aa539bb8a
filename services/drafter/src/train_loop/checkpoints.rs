//! The checkpoint hand-off: a host snapshot of the trainer (the only
//! pause of training), written on a thread of its own while training goes
//! on, reported once durable; a failed write is retried with backoff.

use std::time::{Duration, Instant};

use anyhow::Context;
use dflash_models::ModelError;
use dflash_models::checkpoint::{Checkpoint, CheckpointSnapshot, SnapshotBuffers, TrainerState};
use dflash_telemetry::ErrorKind;

use super::TrainLoop;
use crate::reporter::Report;

/// A checkpoint written on its own thread (`checkpoint.async_write`) from
/// a host snapshot, while the trainer steps on.
pub(super) struct Writing {
    pub(super) step: u64,
    /// How many of `trained` it holds.
    trained: usize,
    batch_ids: Vec<u64>,
    started: Instant,
    /// How long taking the snapshot paused training.
    paused: Duration,
    /// The write's result and the snapshot's buffers, for the next.
    done: flume::Receiver<(Result<Checkpoint, ModelError>, SnapshotBuffers)>,
    thread: std::thread::JoinHandle<()>,
}

/// How often a wait for a checkpoint write says it is still waiting.
const WRITE_WAIT_NOTICE: Duration = Duration::from_secs(30);

/// The next attempt of something that failed, with exponential backoff
/// (the slow delays: a full disk takes a while to clear).
pub(super) struct Retry {
    at: Instant,
    backoff: dflash_role::Backoff,
}

impl Retry {
    pub(super) fn new() -> Self {
        Self { at: Instant::now(), backoff: dflash_role::Backoff::slow() }
    }

    pub(super) fn due(&self) -> bool {
        Instant::now() >= self.at
    }

    /// Schedules the next attempt; returns its delay.
    fn failed(&mut self) -> Duration {
        let d = self.backoff.next_delay();
        self.at = Instant::now() + d;
        d
    }
}

impl TrainLoop {
    /// Takes a checkpoint: a host snapshot of the trainer (the only part
    /// that pauses training), then its write, on a thread of its own with
    /// `checkpoint.async_write`, else here. Its report goes on once it is
    /// durable. A failed write (a full disk) is not fatal: what it wrote is
    /// removed, the last good checkpoint and `latest` stay, the coordinator
    /// hears of the failure (and commits nothing), and the write is tried
    /// again with backoff and at every interval.
    pub(super) fn checkpoint(&mut self) -> anyhow::Result<()> {
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
        let buffers = self.snapshot_buffers.take().unwrap_or_default();
        let snapshot = match CheckpointSnapshot::take_into(&self.trainer, state, buffers) {
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
            self.snapshot_buffers = Some(snapshot.into_buffers());
            self.written(step, trained, batch_ids, (started, started.elapsed()), r);
            return Ok(());
        }
        tracing::debug!("checkpoint of step {step}: {} MiB snapshot on the host", snapshot.bytes() >> 20);
        let (tx, done) = flume::bounded(1);
        let thread = std::thread::Builder::new()
            .name("checkpoint-write".into())
            .spawn(move || {
                let r = snapshot.save(&root, keep);
                let _ = tx.send((r, snapshot.into_buffers()));
            })
            .context("starting the checkpoint writer thread")?;
        self.writing = Some(Writing { step, trained, batch_ids, started, paused, done, thread });
        Ok(())
    }

    /// Hands on the checkpoint being written once its write is over; with
    /// `wait`, waits for it (saying so every [`WRITE_WAIT_NOTICE`]).
    pub(super) fn finish_write(&mut self, wait: bool) -> anyhow::Result<()> {
        let Some(w) = self.writing.as_ref() else { return Ok(()) };
        let result = loop {
            match w.done.recv_timeout(if wait { WRITE_WAIT_NOTICE } else { Duration::ZERO }) {
                Ok((r, buffers)) => {
                    self.snapshot_buffers = Some(buffers);
                    break r;
                }
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
                let full = if e.is_no_space() {
                    format!(
                        "; the disk of {} is full (no space left on device): what this attempt wrote was removed, \
                         free space there",
                        self.checkpoint_dir.display()
                    )
                } else {
                    String::new()
                };
                let err = anyhow::anyhow!(
                    "checkpoint of step {step} failed: {e}{full}; training goes on, the last good checkpoint \
                     (step {}) and `latest` stay, retrying in {:.1} s",
                    self.last_checkpoint_step,
                    delay.as_secs_f64()
                );
                tracing::error!("{err}");
                dflash_telemetry::metrics().errors.with_label_values(&[ErrorKind::CheckpointWrite.label()]).inc();
                self.reporter.send(Report::Error { kind: ErrorKind::CheckpointWrite, error: err });
            }
        }
    }
}

/// The first hex digits of a hash, for messages.
pub(super) fn short(hash: &str) -> &str {
    &hash[..hash.len().min(12)]
}
