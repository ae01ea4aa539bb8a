//! The Drafter gRPC service: accepts hidden-state streams from any number
//! of targets, verifies each batch (CRC, shapes, dtype), queues it in the
//! bounded HS queue and acknowledges it.

use std::pin::Pin;
use std::time::Duration;

use dflash_proto as pb;
use dflash_proto::drafter_server::Drafter;
use dflash_proto::target_message::Msg;
use dflash_role::Stop;
use dflash_wire::{Assembled, Assembler, HostBatch, WireError};
use futures::Stream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

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

pub struct DrafterService {
    /// Pinned landing buffers (None on CPU: payloads assemble in plain memory).
    pub landing: Option<LandingPool>,
    pub run_id: String,
    pub instance_id: String,
    pub credits: u32,
    pub expected: Expected,
    pub max_payload_bytes: usize,
    pub queue: flume::Sender<ReceivedBatch>,
    pub stop: Stop,
    pub hello_timeout: Duration,
}

type AckStream = Pin<Box<dyn Stream<Item = Result<pb::DrafterMessage, Status>> + Send>>;

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

#[tonic::async_trait]
impl Drafter for DrafterService {
    type StreamHiddenStatesStream = AckStream;

    async fn stream_hidden_states(
        &self,
        req: Request<Streaming<pb::TargetMessage>>,
    ) -> Result<Response<AckStream>, Status> {
        let mut incoming = req.into_inner();
        let hello = match tokio::time::timeout(self.hello_timeout, incoming.message()).await {
            Ok(Ok(Some(pb::TargetMessage { msg: Some(Msg::Hello(h)) }))) => h,
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
        let task = StreamTask {
            target,
            assembler: Assembler::new(self.max_payload_bytes),
            landing: self.landing.clone(),
            discarding: None,
            expected: self.expected.clone(),
            queue: self.queue.clone(),
            stop: self.stop.clone(),
            acks: tx,
            receiving: None,
        };
        tokio::spawn(task.run(incoming));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// Receives one target's stream.
struct StreamTask {
    target: String,
    assembler: Assembler,
    landing: Option<LandingPool>,
    /// A corrupt batch whose remaining messages are skipped until its end.
    discarding: Option<u64>,
    expected: Expected,
    queue: flume::Sender<ReceivedBatch>,
    stop: Stop,
    acks: mpsc::Sender<Result<pb::DrafterMessage, Status>>,
    /// The receive span of the batch being assembled.
    receiving: Option<(u64, tracing::Span)>,
}

impl StreamTask {
    async fn run(mut self, mut incoming: Streaming<pb::TargetMessage>) {
        loop {
            let msg = tokio::select! {
                m = incoming.message() => m,
                _ = self.stop.stopped() => return,
            };
            let msg = match msg {
                Ok(Some(m)) => m,
                Ok(None) => {
                    tracing::info!("target {} closed its stream", self.target);
                    return;
                }
                Err(s) => {
                    // E.g. a message over the size limit: tell the target why.
                    tracing::warn!("stream from target {} broke: {}", self.target, s.message());
                    let _ = self.acks.send(Err(s)).await;
                    return;
                }
            };
            if !self.handle(msg).await {
                return;
            }
        }
    }

    /// Handles one message; false ends the stream.
    async fn handle(&mut self, msg: pb::TargetMessage) -> bool {
        let batch_of = |m: &Msg| match m {
            Msg::Header(h) => Some(h.batch_id),
            Msg::Chunk(c) => Some(c.batch_id),
            Msg::End(e) => Some(e.batch_id),
            Msg::Hello(_) => None,
        };
        let Some(m) = msg.msg else { return true };
        if let Some(bad) = self.discarding {
            if batch_of(&m) == Some(bad) {
                if matches!(m, Msg::End(_)) {
                    self.discarding = None;
                    return self.send(ack(bad, pb::AckStatus::Resend, "corrupt in transit".into())).await;
                }
                return true;
            }
            self.discarding = None;
        }
        let is_end = matches!(m, Msg::End(_));
        if let Msg::Header(h) = &m {
            // Continues the target's send span (its context is in the header).
            self.receiving = Some((h.batch_id, dflash_telemetry::batch_span("receive", &h.trace_context, h.batch_id)));
        }
        let result = match m {
            Msg::Header(h) if self.landing.is_some() => self.begin_pinned(h).await,
            Msg::Header(h) => self.assembler.push_header(h),
            Msg::Chunk(c) => self.assembler.push_chunk(c),
            Msg::End(e) => self.assembler.push_end(e),
            Msg::Hello(_) => Err(WireError::Protocol("hello in the middle of a stream".into())),
        };
        match result {
            Ok(Assembled::Pending) => true,
            Ok(Assembled::Batch(batch)) => self.accept(batch).await,
            Err(e) if e.is_retryable() => {
                let id = e.batch_id().or(self.assembler.partial_batch_id()).unwrap_or(0);
                tracing::warn!("from target {}: {e}; asking for a resend", self.target);
                self.assembler.reset();
                // Damage found at the end marker: the batch is over; ask now.
                // Found mid-batch: skip its remaining chunks, ask at its end.
                if is_end {
                    self.send(ack(id, pb::AckStatus::Resend, e.to_string())).await
                } else {
                    self.discarding = Some(id);
                    true
                }
            }
            Err(e) => {
                tracing::error!("from target {}: {e}", self.target);
                let id = e.batch_id().or(self.assembler.partial_batch_id()).unwrap_or(0);
                self.assembler.reset();
                self.send(ack(id, pb::AckStatus::Rejected, e.to_string())).await
            }
        }
    }

    /// Starts a batch in a pinned landing buffer, waiting (bounded by the
    /// pool, cancelled by stop) for one to be free: backpressure.
    async fn begin_pinned(&mut self, h: pb::BatchHeader) -> Result<Assembled, WireError> {
        let meta = self.assembler.check_header(h)?;
        let pool = self.landing.clone().expect("checked by the caller");
        let bytes = meta.payload_bytes();
        let mem = loop {
            if let Some(m) = pool.take(Duration::ZERO) {
                break m;
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(2)) => {}
                _ = self.stop.stopped() => return Err(WireError::Protocol("drafter stopping".into())),
            }
        };
        let limit = mem.capacity();
        let buf = dflash_models::gpu::PinnedBuf::new(mem, bytes).map_err(|_| WireError::TooLarge {
            batch_id: meta.batch_id,
            bytes,
            limit,
        })?;
        self.assembler.begin(meta, Box::new(PinnedPayload { buf, filled: 0 }));
        Ok(Assembled::Pending)
    }

    async fn accept(&mut self, batch: HostBatch) -> bool {
        let id = batch.meta.batch_id;
        let receive = match self.receiving.take() {
            Some((b, span)) if b == id => span,
            _ => dflash_telemetry::batch_span("receive", &batch.meta.trace_context, id),
        };
        if let Err(why) = self.expected.check(&batch) {
            tracing::error!("batch {id} from target {} rejected: {why}", self.target);
            return self.send(ack(id, pb::AckStatus::Rejected, why)).await;
        }
        let m = dflash_telemetry::metrics();
        m.batches.with_label_values(&["received"]).inc();
        m.tokens.with_label_values(&["received"]).inc_by(batch.meta.token_count() as u64);
        m.bytes.with_label_values(&["received"]).inc_by(batch.payload.len() as u64);
        let received = dflash_telemetry::context_of(&receive);
        let queue_wait = dflash_telemetry::batch_span("queue_wait", &received, id);
        let item = ReceivedBatch { batch, queue_wait };
        // Blocks while the HS queue is full: backpressure to the target.
        let queued = tokio::select! {
            r = self.queue.send_async(item) => r.is_ok(),
            _ = self.stop.stopped() => false,
        };
        if !queued {
            return false;
        }
        m.queue_depth.with_label_values(&["hs_queue"]).set(self.queue.len() as i64);
        let acked = dflash_telemetry::batch_span("ack", &received, id);
        drop(receive);
        tracing::Instrument::instrument(self.send(ack(id, pb::AckStatus::Accepted, String::new())), acked).await
    }

    async fn send(&self, m: Result<pb::DrafterMessage, Status>) -> bool {
        self.acks.send(m).await.is_ok()
    }
}
