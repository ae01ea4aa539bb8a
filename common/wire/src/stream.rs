//! Splitting a batch into stream messages and putting it back together.

use bytes::{Bytes, BytesMut};
use dflash_proto as pb;
use pb::target_message::Msg;

use crate::{BatchMeta, HostBatch, WireError};

/// The messages that carry one batch: header, chunks of at most
/// `chunk_bytes` (zero-copy slices of the payload), end marker with CRC32C.
/// Lazy: the CRC is accumulated chunk by chunk as the chunks are handed to
/// the stream, so sending starts at once instead of after a pass over the
/// whole payload.
pub fn batch_messages(batch: &HostBatch, chunk_bytes: usize) -> BatchMessages<'_> {
    assert!(chunk_bytes > 0, "chunk size must be positive");
    BatchMessages { batch, chunk_bytes, next: Next::Header, crc: 0, trace_context: None }
}

/// Iterator over one batch's stream messages (see [`batch_messages`]).
pub struct BatchMessages<'a> {
    batch: &'a HostBatch,
    chunk_bytes: usize,
    next: Next,
    crc: u32,
    trace_context: Option<std::collections::HashMap<String, String>>,
}

enum Next {
    Header,
    Chunk(usize),
    End,
    Done,
}

impl BatchMessages<'_> {
    /// Sends this trace context in the header instead of the batch's own
    /// (the sender's span, so the drafter's spans continue it).
    pub fn with_trace_context(mut self, ctx: std::collections::HashMap<String, String>) -> Self {
        self.trace_context = Some(ctx);
        self
    }

    fn chunk_count(&self) -> usize {
        self.batch.payload.len().div_ceil(self.chunk_bytes)
    }
}

impl Iterator for BatchMessages<'_> {
    type Item = pb::TargetMessage;

    fn next(&mut self) -> Option<pb::TargetMessage> {
        let id = self.batch.meta.batch_id;
        let payload = &self.batch.payload;
        let msg = match self.next {
            Next::Header => {
                let mut h = self.batch.meta.to_header();
                if let Some(ctx) = self.trace_context.take() {
                    h.trace_context = ctx;
                }
                self.next = if payload.is_empty() { Next::End } else { Next::Chunk(0) };
                Msg::Header(h)
            }
            Next::Chunk(i) => {
                let start = i * self.chunk_bytes;
                let end = (start + self.chunk_bytes).min(payload.len());
                self.crc = crc32c::crc32c_append(self.crc, &payload[start..end]);
                self.next = if end == payload.len() { Next::End } else { Next::Chunk(i + 1) };
                Msg::Chunk(pb::BatchChunk { batch_id: id, index: i as u32, data: payload.slice(start..end) })
            }
            Next::End => {
                self.next = Next::Done;
                Msg::End(pb::BatchEnd {
                    batch_id: id,
                    chunk_count: self.chunk_count() as u32,
                    crc32c: self.crc,
                    header_crc32c: self.batch.meta.header_crc(),
                })
            }
            Next::Done => return None,
        };
        Some(pb::TargetMessage { msg: Some(msg) })
    }
}

/// Bytes copied between two CRC updates when a chunk lands: small enough to
/// stay in the core's cache, so the CRC reads the copy's source from cache
/// instead of making a second pass over memory.
const LANDING_STEP: usize = 256 << 10;

/// Where a payload is assembled: growable host memory by default, or a
/// pooled pinned buffer on GPU hosts (so the host-to-device copy is fast).
pub trait PayloadBuffer: Send + Sync {
    /// Appends bytes; the assembler never exceeds the announced size.
    fn extend(&mut self, data: &[u8]);
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The finished payload as shared, immutable bytes.
    fn freeze(self: Box<Self>) -> Bytes;
}

impl PayloadBuffer for BytesMut {
    fn extend(&mut self, data: &[u8]) {
        self.extend_from_slice(data);
    }
    fn len(&self) -> usize {
        BytesMut::len(self)
    }
    fn freeze(self: Box<Self>) -> Bytes {
        BytesMut::freeze(*self)
    }
}

/// Reassembles batches from the messages of one stream, verifying order,
/// sizes and the CRC. Holds at most one partial batch, bounded by
/// `max_payload_bytes`.
pub struct Assembler {
    max_payload_bytes: usize,
    partial: Option<Partial>,
}

struct Partial {
    meta: BatchMeta,
    buf: Box<dyn PayloadBuffer>,
    next_index: u32,
    /// CRC32C of the bytes received so far.
    crc: u32,
}

/// What one pushed message produced.
#[derive(Debug)]
// A batch is produced once per batch and moved straight to the queue, so
// the size difference costs nothing; boxing would add an allocation.
#[allow(clippy::large_enum_variant)]
pub enum Assembled {
    /// More messages are needed.
    Pending,
    /// A complete, verified batch.
    Batch(HostBatch),
}

impl Assembler {
    pub fn new(max_payload_bytes: usize) -> Self {
        Self { max_payload_bytes, partial: None }
    }

    /// The batch being received, if any (to answer it with a resend/reject).
    pub fn partial_batch_id(&self) -> Option<u64> {
        self.partial.as_ref().map(|p| p.meta.batch_id)
    }

    /// Drops the partial batch (after an error was answered).
    pub fn reset(&mut self) {
        self.partial = None;
    }

    /// Feeds a header: the payload assembles in growable host memory.
    pub fn push_header(&mut self, header: pb::BatchHeader) -> Result<Assembled, WireError> {
        let meta = self.check_header(header)?;
        let size = meta.payload_bytes();
        self.begin(meta, Box::new(BytesMut::with_capacity(size)));
        Ok(Assembled::Pending)
    }

    /// Validates a header (consistency, size limit, no batch in progress)
    /// before a buffer is found for its payload.
    pub fn check_header(&self, header: pb::BatchHeader) -> Result<BatchMeta, WireError> {
        if let Some(p) = &self.partial {
            return Err(WireError::Protocol(format!(
                "header of batch {} while batch {} is incomplete",
                header.batch_id, p.meta.batch_id
            )));
        }
        let meta = BatchMeta::from_header(header)?;
        let size = meta.payload_bytes();
        if size > self.max_payload_bytes {
            return Err(WireError::TooLarge { batch_id: meta.batch_id, bytes: size, limit: self.max_payload_bytes });
        }
        Ok(meta)
    }

    /// Starts a checked batch whose payload goes into `buf` (empty).
    pub fn begin(&mut self, meta: BatchMeta, buf: Box<dyn PayloadBuffer>) {
        self.partial = Some(Partial { meta, buf, next_index: 0, crc: 0 });
    }

    pub fn push_chunk(&mut self, chunk: pb::BatchChunk) -> Result<Assembled, WireError> {
        self.push_parts(chunk.batch_id, chunk.index, std::slice::from_ref(&chunk.data))
    }

    /// Feeds a chunk whose data is the concatenation of `parts` (the frames
    /// it arrived in, see [`crate::InboundFrames`]).
    pub fn push_parts(&mut self, batch_id: u64, index: u32, parts: &[Bytes]) -> Result<Assembled, WireError> {
        let p = self.expect(batch_id, "chunk")?;
        if index != p.next_index {
            return Err(WireError::Corrupt {
                batch_id,
                what: format!("chunk {index} arrived where chunk {} was due", p.next_index),
            });
        }
        let expected = p.meta.payload_bytes();
        let len: usize = parts.iter().map(Bytes::len).sum();
        if p.buf.len() + len > expected {
            return Err(WireError::Corrupt {
                batch_id,
                what: format!("chunks exceed the announced {expected} bytes (have {}, chunk {len})", p.buf.len()),
            });
        }
        for piece in parts.iter().flat_map(|part| part.chunks(LANDING_STEP)) {
            p.buf.extend(piece);
            p.crc = crc32c::crc32c_append(p.crc, piece);
        }
        p.next_index += 1;
        Ok(Assembled::Pending)
    }

    pub fn push_end(&mut self, end: pb::BatchEnd) -> Result<Assembled, WireError> {
        let p = self.expect(end.batch_id, "end marker")?;
        let expected = p.meta.payload_bytes();
        if end.chunk_count != p.next_index || p.buf.len() != expected {
            return Err(WireError::Corrupt {
                batch_id: end.batch_id,
                what: format!(
                    "truncated: {} of {} chunks, {} of {expected} bytes",
                    p.next_index,
                    end.chunk_count,
                    p.buf.len()
                ),
            });
        }
        let crc = p.crc;
        if crc != end.crc32c {
            return Err(WireError::Corrupt {
                batch_id: end.batch_id,
                what: format!("CRC32C {crc:#010x} != announced {:#010x}", end.crc32c),
            });
        }
        let header_crc = p.meta.header_crc();
        if header_crc != end.header_crc32c {
            return Err(WireError::Corrupt {
                batch_id: end.batch_id,
                what: format!("header CRC32C {header_crc:#010x} != announced {:#010x}", end.header_crc32c),
            });
        }
        let p = self.partial.take().expect("checked above");
        let payload: Bytes = p.buf.freeze();
        Ok(Assembled::Batch(HostBatch { meta: p.meta, payload }))
    }

    fn expect(&mut self, batch_id: u64, what: &str) -> Result<&mut Partial, WireError> {
        match self.partial.as_ref().map(|p| p.meta.batch_id) {
            Some(id) if id == batch_id => Ok(self.partial.as_mut().expect("checked")),
            Some(id) => Err(WireError::Protocol(format!("{what} of batch {batch_id} while batch {id} is incomplete"))),
            None => Err(WireError::Protocol(format!("{what} of batch {batch_id} without a header"))),
        }
    }
}
