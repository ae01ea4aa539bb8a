//! The Drafter service: accepts hidden-state streams from any number of
//! targets, verifies each batch (CRC, shapes, dtype), queues it in the
//! bounded HS queue and acknowledges it. [`crate::data_plane`] serves it
//! over gRPC.

use std::time::Duration;

use dflash_proto as pb;
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

/// What every batch must match.
#[derive(Clone, Debug)]
pub struct Expected {
    pub hidden_size: u32,
    pub layer_ids: Vec<u32>,
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
    pub stop: Stop,
    pub hello_timeout: Duration,
}

fn ack(batch_id: u64, status: pb::AckStatus, reason: String) -> Result<pb::DrafterMessage, Status> {
    Ok(pb::DrafterMessage {
        msg: Some(pb::drafter_message::Msg::Ack(pb::BatchAck { batch_id, status: status as i32, reason })),
    })
}

impl Expected {
    fn check(&self, b: &HostBatch) -> Result<(), String> {
        if b.meta.hidden_size != self.hidden_size {
            return Err(format!("hidden size {} but the drafter expects {}", b.meta.hidden_size, self.hidden_size));
        }
        if b.meta.layer_ids != self.layer_ids {
            return Err(format!("layers {:?} but the drafter expects {:?}", b.meta.layer_ids, self.layer_ids));
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
            Ok(Ok(_)) => return Err(Status::invalid_argument("the first message of a stream must be a hello")),
            Ok(Err(s)) => return Err(s),
            Err(_) => return Err(Status::deadline_exceeded("no hello within the RPC timeout")),
        };
        if hello.protocol_version != dflash_proto::PROTOCOL_VERSION {
            return Err(Status::failed_precondition(format!(
                "protocol version {} is not supported (this drafter speaks {})",
                hello.protocol_version,
                dflash_proto::PROTOCOL_VERSION
            )));
        }
        if hello.run_id != self.run_id {
            return Err(Status::failed_precondition(format!(
                "wrong run id \"{}\": this drafter trains run \"{}\"",
                hello.run_id, self.run_id
            )));
        }
        let target = hello.target_instance;
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
        tx.send(Ok(welcome)).await.map_err(|_| Status::cancelled("stream closed"))?;
        let lander = Lander {
            target: target.clone(),
            assembler: Assembler::new(self.max_payload_bytes),
            landing: self.landing.clone(),
            discarding: None,
            expected: self.expected.clone(),
            queue: self.queue.clone(),
            stop: self.stop.clone(),
            acks: tx.clone(),
            receiving: None,
        };
        tokio::spawn(receive(target, incoming, lander, tx, self.stop.clone()));
        Ok(rx)
    }
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
async fn receive(target: String, mut incoming: InboundStream, lander: Lander, acks: AckSender, stop: Stop) {
    let (tx, rx) = flume::bounded(LANDING_DEPTH);
    let (done_tx, mut done) = tokio::sync::oneshot::channel::<()>();
    let spawned = std::thread::Builder::new().name(format!("land-{target}")).spawn(move || {
        lander.run(rx);
        let _ = done_tx.send(());
    });
    if let Err(e) = spawned {
        tracing::error!("cannot start the landing thread for target {target}: {e}");
        let _ = acks.send(Err(Status::resource_exhausted("drafter cannot start a landing thread"))).await;
        return;
    }
    loop {
        let msg = tokio::select! {
            m = incoming.next() => m,
            _ = stop.stopped() => return,
            // The lander ended the stream (a closed queue, a dropped ack
            // stream): stop reading.
            _ = &mut done => return,
        };
        match msg {
            Ok(Some(m)) => {
                // Waits while the lander is behind (it waits on the HS queue).
                let sent = tokio::select! {
                    r = tx.send_async(m) => r.is_ok(),
                    _ = stop.stopped() => false,
                };
                if !sent {
                    return;
                }
            }
            Ok(None) => {
                tracing::info!("target {target} closed its stream");
                return;
            }
            Err(s) => {
                // E.g. a message over the size limit: tell the target why.
                tracing::warn!("stream from target {target} broke: {}", s.message());
                let _ = acks.send(Err(s)).await;
                return;
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
    stop: Stop,
    acks: AckSender,
    /// The receive span of the batch being assembled.
    receiving: Option<(u64, tracing::Span)>,
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
        if let Err(why) = self.expected.check(&batch) {
            tracing::error!("batch {id} from target {} rejected: {why}", self.target);
            return self.send(ack(id, pb::AckStatus::Rejected, why));
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
