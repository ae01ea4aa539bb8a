//! Where a stream's batches land: messages reassembled into pooled
//! payload buffers (pinned on GPU drafters), checked, queued and
//! acknowledged, on the stream's own landing thread.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use dflash_proto as pb;
use dflash_proto::target_message::Msg;
use dflash_role::Stop;
use dflash_wire::rpc::AckSender;
use dflash_wire::{Assembled, Assembler, ChunkParts, HostBatch, Inbound, WireError};
use tonic::Status;

use super::{DrafterService, Expected, ack, stopping};
use crate::pipeline::{Arrival, ReceivedBatch};

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

/// One message of a batch, whichever way it was decoded. (Not boxed: one
/// lives at a time, on the landing thread's stack.)
#[allow(clippy::large_enum_variant)]
enum Part {
    Hello,
    Header(pb::BatchHeader),
    Chunk(ChunkParts),
    End(pb::BatchEnd),
}

/// Lands one stream's messages: reassembly into payload buffers, CRC,
/// checks, the HS queue and the acks. Runs on its own thread; every wait
/// is bounded and gives up when the role stops.
pub(super) struct Lander {
    target: String,
    assembler: Assembler,
    landing: Landing,
    /// A batch whose remaining messages are skipped until its end, and the
    /// answer its end gets (corrupt: resend; not leased: rejected).
    discarding: Option<(u64, pb::AckStatus, String)>,
    expected: Expected,
    queue: flume::Sender<Arrival>,
    stop: Stop,
    acks: AckSender,
    /// The receive span of the batch being assembled.
    receiving: Option<(u64, tracing::Span)>,
    /// True while a batch is partly received (its stream may not stall).
    mid_batch: Arc<AtomicBool>,
}

impl Lander {
    /// The lander of `target`'s stream on `service`, acknowledging on `acks`.
    pub(super) fn new(target: &str, service: &DrafterService, acks: AckSender, mid_batch: Arc<AtomicBool>) -> Self {
        Self {
            target: target.to_string(),
            assembler: Assembler::new(service.max_payload_bytes),
            landing: service.landing.clone(),
            discarding: None,
            expected: service.expected.clone(),
            queue: service.queue.clone(),
            stop: service.stop.clone(),
            acks,
            receiving: None,
            mid_batch,
        }
    }

    /// Until the reader closes the channel or a message ends the stream.
    pub(super) fn run(mut self, messages: flume::Receiver<Inbound>) {
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
        if let Some((bad, status, reason)) = &self.discarding {
            if batch_of(&m) == Some(*bad) {
                if matches!(m, Part::End(_)) {
                    let answer = ack(*bad, *status, reason.clone());
                    self.discarding = None;
                    return self.send(answer);
                }
                return true;
            }
            self.discarding = None;
        }
        // A batch this stream holds no lease on takes no landing buffer: its
        // messages are skipped and its end refused (a peer without leases
        // cannot hold the buffers the leased batches need).
        if let Part::Header(h) = &m
            && let Err(reason) = self.expected.leased(h.batch_id, &self.target, &h.lease_token)
        {
            tracing::error!("batch {} from target {} refused: {reason}", h.batch_id, self.target);
            dflash_telemetry::metrics().batches.with_label_values(&["unleased"]).inc();
            self.discarding = Some((h.batch_id, pb::AckStatus::Rejected, reason));
            return true;
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
                let kind = dflash_telemetry::ErrorKind::CorruptBatch.label();
                dflash_telemetry::metrics().errors.with_label_values(&[kind]).inc();
                self.assembler.reset();
                // Damage found at the end marker: the batch is over; ask now.
                // Found mid-batch: skip its remaining chunks, ask at its end.
                if is_end {
                    self.send(ack(id, pb::AckStatus::Resend, e.to_string()))
                } else {
                    self.discarding = Some((id, pb::AckStatus::Resend, "corrupt in transit".into()));
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
                let mem = pool.take_until(self.stop.channel()).ok_or_else(stopping)?;
                let limit = mem.capacity();
                let buf = dflash_models::gpu::PinnedBuf::new(mem, bytes).map_err(|_| WireError::TooLarge {
                    batch_id: meta.batch_id,
                    bytes,
                    limit,
                })?;
                Box::new(PinnedPayload { buf, filled: 0 })
            }
            Landing::Host(pool) => {
                let mut buf = pool.take_until(self.stop.channel()).ok_or_else(stopping)?;
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
            m.errors.with_label_values(&[dflash_telemetry::ErrorKind::BadBatch.label()]).inc();
            if r.skip {
                let skip = pb::TrainedBatch {
                    batch_id: id,
                    skipped: true,
                    skip_reason: format!("rejected: {}", r.reason),
                    member: String::new(),
                };
                if !dflash_role::send_until_stop(&self.queue, Arrival::Rejected(skip), &self.stop) {
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
        if !dflash_role::send_until_stop(&self.queue, Arrival::Batch(ReceivedBatch { batch, queue_wait }), &self.stop) {
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
