//! The Drafter service: accepts hidden-state streams from targets (at most
//! `pipeline.max_target_streams` at once), verifies each batch (CRC,
//! shapes, dtype, and against the run's plan: its id, its samples, token
//! ids inside the vocabulary), queues it in the bounded HS queue and
//! acknowledges it. A batch that fails is rejected, never trained; when it
//! is the plan's batch with bad contents the train loop reports it as
//! skipped. [`crate::data_plane`] serves it over gRPC.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use dflash_proto as pb;
use dflash_proto::DrafterError;
use dflash_proto::target_message::Msg;
use dflash_role::Stop;
use dflash_wire::{Assembled, Assembler, ChunkParts, HostBatch, Inbound, WireError};
use tokio::sync::mpsc;
use tonic::Status;

use crate::data_plane::{AckSender, InboundStream};

/// A verified batch waiting in the HS queue.
pub struct ReceivedBatch {
    pub batch: HostBatch,
    /// Open while the batch waits in the queue; prefetch closes it.
    pub queue_wait: tracing::Span,
}

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
    pub hidden_size: u32,
    pub layer_ids: Vec<u32>,
    /// Rows of the target's embedding: every token id must be below it.
    pub vocab_size: u32,
    pub plan: Arc<Plan>,
}

/// Why a batch is refused, and whether the ledger should hear of it as
/// skipped (the plan's batch, bad contents) or not (not the plan's batch:
/// the genuine one may still come).
#[derive(Debug, PartialEq, Eq)]
pub struct Rejection {
    pub reason: String,
    pub skip: bool,
}

/// Pinned landing buffers for received payloads (GPU drafters).
pub type LandingPool = dflash_models::gpu::Pool<dflash_models::gpu::PinnedMem>;

/// Where received payloads land: pooled buffers either way, so a batch's
/// memory is reused rather than allocated (and page-faulted in) anew, and
/// the number of payloads alive is bounded by the pool.
#[derive(Clone)]
pub enum Landing {
    /// Pinned buffers of a fixed size (GPU drafters: fast host-to-device copies).
    Pinned(LandingPool),
    /// Plain host buffers that keep the capacity they grew to (CPU drafters).
    Host(dflash_models::gpu::Pool<Vec<u8>>),
}

impl Landing {
    /// `count` host buffers, empty until their first batch.
    pub fn host(count: usize) -> Self {
        Landing::Host(dflash_models::gpu::Pool::new((0..count).map(|_| Vec::new()).collect()))
    }
}

impl std::fmt::Display for Landing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Landing::Pinned(_) => "pooled pinned buffers",
            Landing::Host(_) => "pooled host buffers",
        })
    }
}

/// A payload assembling in a pooled pinned buffer.
struct PinnedPayload {
    buf: dflash_models::gpu::PinnedBuf,
    filled: usize,
}

impl dflash_wire::PayloadBuffer for PinnedPayload {
    fn extend(&mut self, data: &[u8]) {
        let end = self.filled + data.len();
        self.buf.as_mut_slice()[self.filled..end].copy_from_slice(data);
        self.filled = end;
    }
    fn len(&self) -> usize {
        self.filled
    }
    fn freeze(self: Box<Self>) -> bytes::Bytes {
        bytes::Bytes::from_owner(self.buf)
    }
}

/// A payload assembling in a pooled host buffer; the buffer returns to its
/// pool when the last reference to the finished payload is dropped.
struct HostPayload(dflash_models::gpu::Pooled<Vec<u8>>);

impl AsRef<[u8]> for HostPayload {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl dflash_wire::PayloadBuffer for HostPayload {
    fn extend(&mut self, data: &[u8]) {
        // Within the capacity reserved at the header: no reallocation.
        self.0.extend_from_slice(data);
    }
    fn len(&self) -> usize {
        self.0.len()
    }
    fn freeze(self: Box<Self>) -> bytes::Bytes {
        bytes::Bytes::from_owner(*self)
    }
}

pub struct DrafterService {
    /// Where payloads land (pinned buffers on GPU drafters, host buffers on CPU).
    pub landing: Landing,
    pub run_id: String,
    pub instance_id: String,
    pub credits: u32,
    pub expected: Expected,
    pub max_payload_bytes: usize,
    pub queue: flume::Sender<ReceivedBatch>,
    /// Rejected batches of the plan, for the train loop to report as skipped.
    pub skipped: flume::Sender<pb::TrainedBatch>,
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
    /// Checks a complete batch against the drafter's shape and the plan.
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
        if m.layer_ids != self.layer_ids {
            return bad(format!("layers {:?} but the drafter expects {:?}", m.layer_ids, self.layer_ids));
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

impl DrafterService {
    /// Starts one target's stream: checks its hello, then receives on a
    /// task of its own; returns the acknowledgements to send back, the
    /// welcome first. An error refuses the stream.
    pub async fn open_stream(
        &self,
        mut incoming: InboundStream,
    ) -> Result<mpsc::Receiver<Result<pb::DrafterMessage, Status>>, Status> {
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
        incoming.allow_messages_up_to(dflash_role::transport::MAX_MESSAGE_BYTES);
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
        let lander = Lander {
            target: target.clone(),
            assembler: Assembler::new(self.max_payload_bytes),
            landing: self.landing.clone(),
            discarding: None,
            expected: self.expected.clone(),
            queue: self.queue.clone(),
            skipped: self.skipped.clone(),
            stop: self.stop.clone(),
            acks: tx.clone(),
            receiving: None,
            mid_batch: Arc::clone(&mid_batch),
        };
        let name = format!("stream-{target}");
        let stream =
            Stream { target, incoming, acks: tx, stop: self.stop.clone(), stall: self.stall_timeout, mid_batch };
        self.stages.spawn_task(&name, async move {
            receive(stream, lander).await;
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
async fn receive(s: Stream, lander: Lander) {
    let (messages, mut landed) = start_landing(&s.target, lander);
    let Some(messages) = messages else {
        let _ = s.acks.send(Err(Status::resource_exhausted("drafter cannot start a landing thread"))).await;
        return;
    };
    if !read_stream(s, messages, &mut landed).await {
        // The landing thread ends once its input closes (dropped by now)
        // and its batch is handed on or given up: the stream is over when
        // it is.
        let _ = landed.await;
    }
}

/// Starts the landing thread of a stream; its input, and a signal that it ended.
fn start_landing(target: &str, lander: Lander) -> (Option<flume::Sender<Inbound>>, tokio::sync::oneshot::Receiver<()>) {
    let (tx, rx) = flume::bounded(LANDING_DEPTH);
    let (done_tx, done) = tokio::sync::oneshot::channel::<()>();
    let spawned = std::thread::Builder::new().name(format!("land-{target}")).spawn(move || {
        lander.run(rx);
        let _ = done_tx.send(());
    });
    if let Err(e) = spawned {
        tracing::error!("cannot start the landing thread for target {target}: {e}");
        return (None, done);
    }
    (Some(tx), done)
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

/// One message of a batch, whichever way it was decoded.
enum Part {
    Hello,
    Header(pb::BatchHeader),
    Chunk(ChunkParts),
    End(pb::BatchEnd),
}

/// Lands one stream's messages: reassembly into payload buffers, CRC,
/// checks, the HS queue and the acks. Runs on its own thread; every wait
/// is bounded and gives up when the role stops.
struct Lander {
    target: String,
    assembler: Assembler,
    landing: Landing,
    /// A corrupt batch whose remaining messages are skipped until its end.
    discarding: Option<u64>,
    expected: Expected,
    queue: flume::Sender<ReceivedBatch>,
    skipped: flume::Sender<pb::TrainedBatch>,
    stop: Stop,
    acks: AckSender,
    /// The receive span of the batch being assembled.
    receiving: Option<(u64, tracing::Span)>,
    /// True while a batch is partly received (its stream may not stall).
    mid_batch: Arc<AtomicBool>,
}

impl Lander {
    /// Until the reader closes the channel or a message ends the stream.
    fn run(mut self, messages: flume::Receiver<Inbound>) {
        while let Ok(m) = messages.recv() {
            if !self.handle(m) {
                return;
            }
        }
    }

    /// Handles one message; false ends the stream.
    fn handle(&mut self, inbound: Inbound) -> bool {
        let m = match inbound {
            Inbound::Chunk(c) => Part::Chunk(c),
            Inbound::Message(pb::TargetMessage { msg: Some(m) }) => match m {
                Msg::Header(h) => Part::Header(h),
                Msg::Chunk(c) => Part::Chunk(ChunkParts { batch_id: c.batch_id, index: c.index, parts: vec![c.data] }),
                Msg::End(e) => Part::End(e),
                Msg::Hello(_) => Part::Hello,
            },
            Inbound::Message(pb::TargetMessage { msg: None }) => return true,
        };
        let batch_of = |m: &Part| match m {
            Part::Header(h) => Some(h.batch_id),
            Part::Chunk(c) => Some(c.batch_id),
            Part::End(e) => Some(e.batch_id),
            Part::Hello => None,
        };
        if let Some(bad) = self.discarding {
            if batch_of(&m) == Some(bad) {
                if matches!(m, Part::End(_)) {
                    self.discarding = None;
                    return self.send(ack(bad, pb::AckStatus::Resend, "corrupt in transit".into()));
                }
                return true;
            }
            self.discarding = None;
        }
        let is_end = matches!(m, Part::End(_));
        if let Part::Header(h) = &m {
            // Continues the target's send span (its context is in the header).
            self.receiving = Some((h.batch_id, dflash_telemetry::batch_span("receive", &h.trace_context, h.batch_id)));
        }
        let result = match m {
            Part::Header(h) => self.begin_pooled(h),
            Part::Chunk(c) => self.assembler.push_parts(c.batch_id, c.index, &c.parts),
            Part::End(e) => self.assembler.push_end(e),
            Part::Hello => Err(WireError::Protocol("hello in the middle of a stream".into())),
        };
        self.mid_batch.store(self.assembler.partial_batch_id().is_some(), Ordering::Release);
        match result {
            Ok(Assembled::Pending) => true,
            Ok(Assembled::Batch(batch)) => self.accept(batch),
            Err(e) if e.is_retryable() => {
                let id = e.batch_id().or(self.assembler.partial_batch_id()).unwrap_or(0);
                tracing::warn!("from target {}: {e}; asking for a resend", self.target);
                self.assembler.reset();
                // Damage found at the end marker: the batch is over; ask now.
                // Found mid-batch: skip its remaining chunks, ask at its end.
                if is_end {
                    self.send(ack(id, pb::AckStatus::Resend, e.to_string()))
                } else {
                    self.discarding = Some(id);
                    true
                }
            }
            Err(e) => {
                tracing::error!("from target {}: {e}", self.target);
                let id = e.batch_id().or(self.assembler.partial_batch_id()).unwrap_or(0);
                self.assembler.reset();
                self.send(ack(id, pb::AckStatus::Rejected, e.to_string()))
            }
        }
    }

    /// Starts a batch in a pooled landing buffer, waiting (bounded by the
    /// pool, cancelled by stop) for one to be free: backpressure.
    fn begin_pooled(&mut self, h: pb::BatchHeader) -> Result<Assembled, WireError> {
        let meta = self.assembler.check_header(h)?;
        let bytes = meta.payload_bytes();
        let buf: Box<dyn dflash_wire::PayloadBuffer> = match &self.landing {
            Landing::Pinned(pool) => {
                let mem = pool.take_until(|| self.stop.is_stopped()).ok_or_else(stopping)?;
                let limit = mem.capacity();
                let buf = dflash_models::gpu::PinnedBuf::new(mem, bytes).map_err(|_| WireError::TooLarge {
                    batch_id: meta.batch_id,
                    bytes,
                    limit,
                })?;
                Box::new(PinnedPayload { buf, filled: 0 })
            }
            Landing::Host(pool) => {
                let mut buf = pool.take_until(|| self.stop.is_stopped()).ok_or_else(stopping)?;
                buf.clear();
                if buf.capacity() < bytes {
                    // Grow without copying the old contents (the header
                    // check bounds `bytes` by the largest payload).
                    *buf = Vec::with_capacity(bytes);
                }
                Box::new(HostPayload(buf))
            }
        };
        self.assembler.begin(meta, buf);
        Ok(Assembled::Pending)
    }

    fn accept(&mut self, batch: HostBatch) -> bool {
        let id = batch.meta.batch_id;
        let receive = match self.receiving.take() {
            Some((b, span)) if b == id => span,
            _ => dflash_telemetry::batch_span("receive", &batch.meta.trace_context, id),
        };
        if let Err(r) = self.expected.check(&batch, &self.target) {
            tracing::error!("batch {id} from target {} rejected: {}", self.target, r.reason);
            let m = dflash_telemetry::metrics();
            m.batches.with_label_values(&["rejected"]).inc();
            m.errors.with_label_values(&[dflash_telemetry::ErrorKind::BadBatch.as_str()]).inc();
            if r.skip {
                let skip =
                    pb::TrainedBatch { batch_id: id, skipped: true, skip_reason: format!("rejected: {}", r.reason) };
                if !dflash_role::send_until_stop(&self.skipped, skip, &self.stop) {
                    return false;
                }
            }
            return self.send(ack(id, pb::AckStatus::Rejected, r.reason));
        }
        let m = dflash_telemetry::metrics();
        m.batches.with_label_values(&["received"]).inc();
        m.tokens.with_label_values(&["received"]).inc_by(batch.meta.token_count() as u64);
        m.bytes.with_label_values(&["received"]).inc_by(batch.payload.len() as u64);
        let received = dflash_telemetry::context_of(&receive);
        let queue_wait = dflash_telemetry::batch_span("queue_wait", &received, id);
        // Blocks while the HS queue is full: backpressure to the target.
        if !dflash_role::send_until_stop(&self.queue, ReceivedBatch { batch, queue_wait }, &self.stop) {
            return false;
        }
        m.queue_depth.with_label_values(&["hs_queue"]).set(self.queue.len() as i64);
        let _acked = dflash_telemetry::batch_span("ack", &received, id).entered();
        drop(receive);
        self.send(ack(id, pb::AckStatus::Accepted, String::new()))
    }

    fn send(&self, m: Result<pb::DrafterMessage, Status>) -> bool {
        self.acks.blocking_send(m).is_ok()
    }
}
