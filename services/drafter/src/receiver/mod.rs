//! The Drafter service: accepts hidden-state streams from targets (at most
//! `pipeline.max_target_streams` at once), verifies each batch (CRC,
//! shapes, dtype, and against the run's plan: its id, its samples, token
//! ids inside the vocabulary), queues it in the bounded HS queue and
//! acknowledges it. A batch that fails is rejected, never trained; when it
//! is the plan's batch with bad contents the train loop reports it as
//! skipped. [`dflash_wire::rpc::HiddenStateService`] serves it over gRPC;
//! [`landing`] reassembles each stream's batches into pooled buffers.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use dflash_proto as pb;
use dflash_proto::DrafterError;
use dflash_proto::target_message::Msg;
use dflash_role::Stop;
use dflash_wire::rpc::{AckReceiver, AckSender, InboundStream, StreamHandler};
use dflash_wire::{FeatureSpec, HostBatch, Inbound, WireError};

use tokio::sync::mpsc;
use tonic::Status;

use crate::pipeline::Arrival;

mod landing;
#[cfg(test)]
mod tests;

use landing::Lander;
pub use landing::{Landing, LandingPool};

/// One planned batch: what a batch of this id must hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Planned {
    pub epoch: u32,
    pub sample_ids: Vec<u64>,
    pub sample_lengths: Vec<u32>,
}

/// The run's plan by batch id (from the coordinator's ledger).
pub type Plan = HashMap<u64, Planned>;

/// What every batch must match.
#[derive(Clone, Debug)]
pub struct Expected {
    /// Layers, dtype and layout of the run's features.
    pub spec: FeatureSpec,
    pub hidden_size: u32,
    /// Rows of the target's embedding: every token id must be below it.
    pub vocab_size: u32,
    pub plan: Arc<Plan>,
    /// The run and its lease key: a batch is taken only from the target
    /// instance it is leased to (`dflash_proto::lease_token`).
    pub run_id: String,
    pub lease_key: Arc<[u8]>,
}

/// Why a batch is refused, and whether the ledger should hear of it as
/// skipped (the plan's batch, bad contents) or not (not the plan's batch:
/// the genuine one may still come).
#[derive(Debug, PartialEq, Eq)]
pub struct Rejection {
    pub reason: String,
    pub skip: bool,
}

pub struct DrafterService {
    /// Where payloads land (pinned buffers on GPU drafters, host buffers on CPU).
    pub landing: Landing,
    pub run_id: String,
    pub instance_id: String,
    pub credits: u32,
    pub expected: Expected,
    pub max_payload_bytes: usize,
    /// The HS queue: accepted batches, and rejected ones of the plan (the
    /// train loop reports them as skipped in their place in the order).
    pub queue: flume::Sender<Arrival>,
    pub stop: Stop,
    pub hello_timeout: Duration,
    /// A stream mid-batch that brings nothing this long is ended.
    pub stall_timeout: Duration,
    /// Permits for open streams (`pipeline.max_target_streams`).
    pub streams: Arc<tokio::sync::Semaphore>,
    pub max_streams: usize,
    /// Owns every stream's reading task (the role's stages).
    pub stages: dflash_role::Stages,
}

fn ack(batch_id: u64, status: pb::AckStatus, reason: String) -> Result<pb::DrafterMessage, Status> {
    Ok(pb::DrafterMessage {
        msg: Some(pb::drafter_message::Msg::Ack(pb::BatchAck { batch_id, status: status as i32, reason })),
    })
}

impl Expected {
    /// Whether `token` shows batch `batch_id` leased to `target` (the
    /// refusal's reason otherwise).
    pub fn leased(&self, batch_id: u64, target: &str, token: &[u8]) -> Result<(), String> {
        if dflash_proto::lease_token::verify(&self.lease_key, &self.run_id, batch_id, target, token) {
            Ok(())
        } else {
            Err(format!(
                "batch {batch_id} carries no valid lease token for target {target}: it is not leased to that instance"
            ))
        }
    }

    /// Checks a complete batch against the drafter's shape and the plan
    /// (its lease was checked at its header: [`Expected::leased`]).
    pub fn check(&self, b: &HostBatch, stream_target: &str) -> Result<(), Rejection> {
        let m = &b.meta;
        let refuse = |reason: String| Err(Rejection { reason, skip: false });
        if m.target_instance != stream_target {
            return refuse(format!(
                "header names target {:?} but the stream is {stream_target}'s",
                m.target_instance.escape_debug().to_string()
            ));
        }
        let Some(p) = self.plan.get(&m.batch_id) else {
            return refuse(format!("batch {} is not in the run's plan", m.batch_id));
        };
        if m.epoch != p.epoch || m.sample_ids != p.sample_ids || m.seq_lengths != p.sample_lengths {
            return refuse(format!(
                "batch {} holds samples {:?} of lengths {:?} (epoch {}) but the plan has {:?} of lengths {:?} (epoch {})",
                m.batch_id, m.sample_ids, m.seq_lengths, m.epoch, p.sample_ids, p.sample_lengths, p.epoch
            ));
        }
        let bad = |reason: String| Err(Rejection { reason, skip: true });
        if m.hidden_size != self.hidden_size {
            return bad(format!("hidden size {} but the drafter expects {}", m.hidden_size, self.hidden_size));
        }
        if let Some(why) = self.spec.mismatch(m) {
            return bad(why);
        }
        if let Some((i, &t)) = m.input_ids.iter().enumerate().find(|&(_, &t)| t >= self.vocab_size) {
            return bad(format!("token id {t} at position {i} is outside the vocabulary ({})", self.vocab_size));
        }
        if let Some((i, &v)) = m.loss_mask.iter().enumerate().find(|&(_, &v)| v > 1) {
            return bad(format!("loss mask byte {v} at position {i} is neither 0 nor 1"));
        }
        Ok(())
    }
}

impl StreamHandler for DrafterService {
    /// Starts one target's stream: checks its hello, then receives on a
    /// task of its own; returns the acknowledgements to send back, the
    /// welcome first. An error refuses the stream.
    async fn open_stream(&self, mut incoming: InboundStream) -> Result<AckReceiver, Status> {
        let hello = match tokio::time::timeout(self.hello_timeout, incoming.next()).await {
            Ok(Ok(Some(Inbound::Message(pb::TargetMessage { msg: Some(Msg::Hello(h)) })))) => h,
            Ok(Ok(_)) => return Err(DrafterError::NoHello.into()),
            Ok(Err(s)) => return Err(s),
            Err(_) => return Err(DrafterError::HelloTimeout { ms: self.hello_timeout.as_millis() as u64 }.into()),
        };
        if hello.protocol_version != dflash_proto::PROTOCOL_VERSION {
            return Err(DrafterError::ProtocolVersion {
                got: hello.protocol_version,
                speaks: dflash_proto::PROTOCOL_VERSION,
            }
            .into());
        }
        if hello.run_id != self.run_id {
            return Err(DrafterError::WrongRun { got: hello.run_id, trains: self.run_id.clone() }.into());
        }
        let target = hello.target_instance;
        dflash_proto::check_instance_id(&target).map_err(DrafterError::BadInstanceId)?;
        let Ok(permit) = Arc::clone(&self.streams).try_acquire_owned() else {
            return Err(DrafterError::TooManyStreams { max: self.max_streams as u64 }.into());
        };
        incoming.allow_messages_up_to(dflash_wire::rpc::transport::MAX_MESSAGE_BYTES);
        tracing::info!("target {target} connected");
        // Acks are bounded by the credits; the extra room keeps this task
        // from ever blocking on a slow reader of acks.
        let (tx, rx) = mpsc::channel(self.credits as usize + 4);
        let welcome = pb::DrafterMessage {
            msg: Some(pb::drafter_message::Msg::Welcome(pb::StreamWelcome {
                drafter_instance: self.instance_id.clone(),
                credits: self.credits,
            })),
        };
        tx.send(Ok(welcome)).await.map_err(|_| DrafterError::Stopping)?;
        let mid_batch = Arc::new(AtomicBool::new(false));
        let lander = Lander::new(&target, self, tx.clone(), Arc::clone(&mid_batch));
        let name = format!("stream-{target}");
        let stream =
            Stream { target, incoming, acks: tx, stop: self.stop.clone(), stall: self.stall_timeout, mid_batch };
        let stages = self.stages.clone();
        self.stages.spawn_task(&name, async move {
            receive(stream, lander, &stages).await;
            drop(permit);
            Ok(())
        });
        Ok(rx)
    }
}

/// One open stream, as its reading task holds it.
struct Stream {
    target: String,
    incoming: InboundStream,
    acks: AckSender,
    stop: Stop,
    /// How long a batch in progress may wait for its next message.
    stall: Duration,
    /// Set by the lander while a batch is partly received.
    mid_batch: Arc<AtomicBool>,
}

fn stopping() -> WireError {
    WireError::Protocol("drafter stopping".into())
}

/// Messages decoded but not yet landed, per stream: with 4 MiB chunks,
/// 16 MiB of decoded chunks wait at most while the lander copies one.
const LANDING_DEPTH: usize = 4;

/// Reads one target's stream: this task cuts the HTTP/2 frames into
/// messages while a thread of the stream's own (the [`Lander`]) copies the
/// previous chunks into their payload buffers and checks them, so reading
/// the socket and landing run on two cores.
async fn receive(s: Stream, lander: Lander, stages: &dflash_role::Stages) {
    let (messages, mut landed) = start_landing(&s.target, lander, stages);
    let messages = match messages {
        Ok(m) => m,
        Err(e) => {
            tracing::error!("cannot start the landing thread for target {}: {e}", s.target);
            let refusal = DrafterError::Overloaded(format!("no landing thread: {e}"));
            let _ = s.acks.send(Err(refusal.into())).await;
            return;
        }
    };
    if !read_stream(s, messages, &mut landed).await {
        // The landing thread ends once its input closes (dropped by now)
        // and its batch is handed on or given up: the stream is over when
        // it is.
        let _ = landed.await;
    }
}

/// Starts the landing thread of a stream (owned by the role's stages, so
/// stopping joins it); its input, and a signal that it ended.
fn start_landing(
    target: &str,
    lander: Lander,
    stages: &dflash_role::Stages,
) -> (std::io::Result<flume::Sender<Inbound>>, tokio::sync::oneshot::Receiver<()>) {
    let (tx, rx) = flume::bounded(LANDING_DEPTH);
    let (done_tx, done) = tokio::sync::oneshot::channel::<()>();
    let spawned = stages.try_spawn_thread(&format!("land-{target}"), move || {
        lander.run(rx);
        let _ = done_tx.send(());
        Ok(())
    });
    (spawned.map(|()| tx), done)
}

/// Cuts the stream into messages for the landing thread until it ends;
/// true when it ended because the landing thread did.
async fn read_stream(s: Stream, tx: flume::Sender<Inbound>, done: &mut tokio::sync::oneshot::Receiver<()>) -> bool {
    let Stream { target, mut incoming, acks, stop, stall, mid_batch } = s;
    // A batch in progress holds a landing buffer: it may not wait for its
    // next message forever. Checked a few times per stall period.
    let tick = (stall / 4).max(Duration::from_millis(25));
    let mut last_message = std::time::Instant::now();
    loop {
        let msg = tokio::select! {
            m = tokio::time::timeout(tick, incoming.next()) => match m {
                Ok(m) => m,
                Err(_) if mid_batch.load(Ordering::Acquire) && last_message.elapsed() >= stall => {
                    tracing::warn!("stream from target {target} stalled mid-batch for {stall:?}: ending it");
                    let _ = acks
                        .send(Err(DrafterError::Stalled { ms: stall.as_millis() as u64 }.into()))
                        .await;
                    return false;
                }
                Err(_) => continue,
            },
            _ = stop.stopped() => return false,
            // The lander ended the stream (a closed queue, a dropped ack
            // stream): stop reading.
            _ = &mut *done => return true,
        };
        last_message = std::time::Instant::now();
        match msg {
            Ok(Some(m)) => {
                // Waits while the lander is behind (it waits on the HS queue).
                let sent = tokio::select! {
                    r = tx.send_async(m) => r.is_ok(),
                    _ = stop.stopped() => false,
                };
                if !sent {
                    return false;
                }
            }
            Ok(None) => {
                tracing::info!("target {target} closed its stream");
                return false;
            }
            Err(s) => {
                // E.g. a message over the size limit: tell the target why.
                tracing::warn!("stream from target {target} broke: {}", s.message());
                let _ = acks.send(Err(s)).await;
                return false;
            }
        }
    }
}
