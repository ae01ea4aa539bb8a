//! The drafter's side of the hidden-state stream, below gRPC's message
//! layer: the bytes of a target's request body, in the HTTP/2 frames they
//! arrived in, cut into gRPC messages without copying chunk payloads.
//!
//! A generic gRPC server copies every message out of its frames into one
//! contiguous buffer before decoding it; for a 4 MiB chunk that is a full
//! pass over memory that the drafter then repeats to land the payload in
//! its (pinned) buffer. Here a chunk's payload stays in the frames it came
//! in ([`ChunkParts`]) and is copied once, into the landing buffer. Every
//! other message (hello, header, end marker), and a chunk encoded in any
//! layout other than the usual field order, is decoded by prost as usual.

use std::collections::VecDeque;

use bytes::{Buf, Bytes, BytesMut};
use dflash_proto as pb;
use prost::Message;

/// gRPC's message prefix: a compression flag and a big-endian length.
const PREFIX: usize = 5;

/// Bytes of a chunk message read to find where its payload starts: the
/// oneof's key and length, then batch id, index, and the data field's key
/// and length (at most 1 + 5 + 11 + 6 + 1 + 10 bytes as varints).
const CHUNK_HEAD: usize = 48;

/// One message of the stream. (A few hundred bytes either way, a handful
/// in flight per stream: not worth a box per message.)
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Inbound {
    /// Decoded by prost (hello, header, end marker; an unusual chunk).
    Message(pb::TargetMessage),
    /// A chunk whose payload is still in the frames it arrived in.
    Chunk(ChunkParts),
}

/// A [`pb::BatchChunk`] whose data is the concatenation of `parts`.
#[derive(Debug)]
pub struct ChunkParts {
    pub batch_id: u64,
    pub index: u32,
    pub parts: Vec<Bytes>,
}

impl ChunkParts {
    pub fn len(&self) -> usize {
        self.parts.iter().map(Bytes::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Why the stream's bytes are not a valid sequence of messages.
#[derive(Debug, thiserror::Error)]
pub enum InboundError {
    /// Worded as tonic words it, so clients see the usual message.
    #[error("message length too large: found {len} bytes, the limit is: {limit} bytes")]
    TooLarge { len: usize, limit: usize },
    #[error("compressed messages are not supported on the hidden-state stream")]
    Compressed,
    #[error("the stream ended inside a message ({0} bytes left over)")]
    Truncated(usize),
    #[error("malformed message: {0}")]
    Decode(#[from] prost::DecodeError),
}

/// Frames received and not yet cut into messages. Holds at most one
/// message (bounded by `max_message`) plus the frame that completed it.
pub struct InboundFrames {
    frames: VecDeque<Bytes>,
    /// Bytes in `frames`.
    queued: usize,
    max_message: usize,
}

impl InboundFrames {
    pub fn new(max_message: usize) -> Self {
        Self { frames: VecDeque::new(), queued: 0, max_message }
    }

    /// Changes the largest message accepted from now on (a stream takes a
    /// small hello first and its chunks after).
    pub fn set_max_message(&mut self, max_message: usize) {
        self.max_message = max_message;
    }

    /// Appends the payload of one DATA frame.
    pub fn push(&mut self, frame: Bytes) {
        if !frame.is_empty() {
            self.queued += frame.len();
            self.frames.push_back(frame);
        }
    }

    /// The next complete message, or `None` until more frames arrive.
    pub fn next_message(&mut self) -> Result<Option<Inbound>, InboundError> {
        if self.queued < PREFIX {
            return Ok(None);
        }
        let mut prefix = [0u8; PREFIX];
        self.peek(&mut prefix);
        if prefix[0] != 0 {
            return Err(InboundError::Compressed);
        }
        let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
        if len > self.max_message {
            return Err(InboundError::TooLarge { len, limit: self.max_message });
        }
        if self.queued < PREFIX + len {
            return Ok(None);
        }
        let mut head = [0u8; PREFIX + CHUNK_HEAD];
        let head_len = (PREFIX + len).min(head.len());
        self.peek(&mut head[..head_len]);
        if let Some((chunk_head, batch_id, index)) = chunk_layout(&head[PREFIX..head_len], len) {
            self.advance(PREFIX + chunk_head);
            let parts = self.take(len - chunk_head);
            return Ok(Some(Inbound::Chunk(ChunkParts { batch_id, index, parts })));
        }
        self.advance(PREFIX);
        let parts = self.take(len);
        let bytes = match parts.len() {
            0 => Bytes::new(),
            1 => parts.into_iter().next().expect("one part"),
            _ => {
                let mut joined = BytesMut::with_capacity(len);
                parts.iter().for_each(|p| joined.extend_from_slice(p));
                joined.freeze()
            }
        };
        Ok(Some(Inbound::Message(pb::TargetMessage::decode(bytes)?)))
    }

    /// At the end of the body: an error if a message was left incomplete.
    pub fn finish(&self) -> Result<(), InboundError> {
        match self.queued {
            0 => Ok(()),
            n => Err(InboundError::Truncated(n)),
        }
    }

    /// Copies the first `out.len()` queued bytes (the caller checked there are enough).
    fn peek(&self, out: &mut [u8]) {
        let mut filled = 0;
        for f in &self.frames {
            let n = (out.len() - filled).min(f.len());
            out[filled..filled + n].copy_from_slice(&f[..n]);
            filled += n;
            if filled == out.len() {
                break;
            }
        }
    }

    fn advance(&mut self, mut n: usize) {
        self.queued -= n;
        while n > 0 {
            let front = self.frames.front_mut().expect("advance within the queued bytes");
            if front.len() <= n {
                n -= front.len();
                self.frames.pop_front();
            } else {
                front.advance(n);
                n = 0;
            }
        }
    }

    /// The next `n` bytes as zero-copy slices of the frames.
    fn take(&mut self, mut n: usize) -> Vec<Bytes> {
        self.queued -= n;
        let mut parts = Vec::new();
        while n > 0 {
            let front = self.frames.front_mut().expect("take within the queued bytes");
            if front.len() <= n {
                n -= front.len();
                parts.push(self.frames.pop_front().expect("front exists"));
            } else {
                parts.push(front.split_to(n));
                n = 0;
            }
        }
        parts
    }
}

/// Recognizes a `TargetMessage { chunk: BatchChunk { batch_id, index, data } }`
/// of `len` bytes whose `data` field comes last (as prost writes it) from its
/// first bytes `head`; returns how many bytes precede the payload, the batch
/// id and the index. `None` means "decode it the usual way".
fn chunk_layout(head: &[u8], len: usize) -> Option<(usize, u64, u32)> {
    use prost::encoding::{WireType, decode_key, decode_varint};
    let mut buf = head;
    let at = |buf: &[u8]| head.len() - buf.len();
    // The oneof: field 3 (chunk), length-delimited, spanning the whole message.
    if decode_key(&mut buf).ok()? != (3, WireType::LengthDelimited) {
        return None;
    }
    let inner = usize::try_from(decode_varint(&mut buf).ok()?).ok()?;
    if at(buf) + inner != len {
        return None;
    }
    let (mut batch_id, mut index) = (0u64, 0u32);
    loop {
        match decode_key(&mut buf).ok()? {
            (1, WireType::Varint) => batch_id = decode_varint(&mut buf).ok()?,
            (2, WireType::Varint) => index = u32::try_from(decode_varint(&mut buf).ok()?).ok()?,
            (3, WireType::LengthDelimited) => {
                let data = usize::try_from(decode_varint(&mut buf).ok()?).ok()?;
                let start = at(buf);
                return (start + data == len).then_some((start, batch_id, index));
            }
            _ => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pb::target_message::Msg;

    use crate::outbound::grpc_pieces;
    use crate::outbound::tests::generic as framed;

    fn chunk(batch_id: u64, index: u32, data: Vec<u8>) -> pb::TargetMessage {
        pb::TargetMessage { msg: Some(Msg::Chunk(pb::BatchChunk { batch_id, index, data: data.into() })) }
    }

    fn end(batch_id: u64) -> pb::TargetMessage {
        pb::TargetMessage {
            msg: Some(Msg::End(pb::BatchEnd { batch_id, chunk_count: 2, crc32c: 7, header_crc32c: 0 })),
        }
    }

    /// Feeds `stream` in frames of `frame` bytes and collects every message.
    fn read_all(stream: &[u8], frame: usize) -> Vec<Inbound> {
        let mut frames = InboundFrames::new(1 << 20);
        let mut out = Vec::new();
        for f in stream.chunks(frame) {
            frames.push(Bytes::copy_from_slice(f));
            while let Some(m) = frames.next_message().unwrap() {
                out.push(m);
            }
        }
        frames.finish().unwrap();
        out
    }

    #[test]
    fn chunks_come_out_as_their_frames_and_other_messages_decoded() {
        let payload: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        // Index 0 and batch id 0 are omitted on the wire (proto3 defaults).
        let msgs = [chunk(0, 0, payload.clone()), chunk(300, 70_000, payload[..3].to_vec()), end(300)];
        let stream: Vec<u8> = msgs.iter().flat_map(framed).collect();
        // Frame sizes that split prefixes, keys and payloads everywhere.
        for frame in [1, 2, 3, 5, 7, 64, 999, 4096, stream.len()] {
            let got = read_all(&stream, frame);
            assert_eq!(got.len(), 3, "frame size {frame}");
            let Inbound::Chunk(c) = &got[0] else { panic!("{:?}", got[0]) };
            assert_eq!((c.batch_id, c.index), (0, 0));
            assert_eq!(c.parts.concat(), payload, "frame size {frame}");
            if frame >= 64 {
                // Big frames: the payload is a few slices, not a copy per byte.
                assert!(c.parts.len() <= payload.len() / frame + 2, "{} parts", c.parts.len());
            }
            let Inbound::Chunk(c) = &got[1] else { panic!("{:?}", got[1]) };
            assert_eq!((c.batch_id, c.index, c.parts.concat()), (300, 70_000, payload[..3].to_vec()));
            assert!(matches!(&got[2], Inbound::Message(m) if *m == end(300)));
        }
    }

    #[test]
    fn payload_slices_share_the_frames_memory() {
        let payload = vec![9u8; 1 << 16];
        let stream = framed(&chunk(5, 1, payload));
        let head = stream.len() - (1 << 16);
        let frame = Bytes::from(stream);
        let base = frame.as_ptr() as usize;
        let mut frames = InboundFrames::new(1 << 20);
        frames.push(frame.clone());
        let Some(Inbound::Chunk(c)) = frames.next_message().unwrap() else { panic!() };
        assert_eq!(c.parts.len(), 1);
        let at = c.parts[0].as_ptr() as usize;
        assert_eq!(at, base + head, "the payload is a slice of the frame, not a copy");
    }

    #[test]
    fn a_chunk_in_another_field_order_is_decoded_the_usual_way() {
        // data (3) before batch_id (1): valid protobuf, not the fast layout.
        let mut inner = Vec::new();
        prost::encoding::bytes::encode(3, &Bytes::from_static(b"abc"), &mut inner);
        prost::encoding::uint64::encode(1, &9, &mut inner);
        let mut body = Vec::new();
        prost::encoding::encode_key(3, prost::encoding::WireType::LengthDelimited, &mut body);
        prost::encoding::encode_varint(inner.len() as u64, &mut body);
        body.extend_from_slice(&inner);
        let mut stream = vec![0u8];
        stream.extend_from_slice(&(body.len() as u32).to_be_bytes());
        stream.extend_from_slice(&body);
        let got = read_all(&stream, 4);
        assert!(matches!(&got[..], [Inbound::Message(m)] if *m == chunk(9, 0, b"abc".to_vec())), "{got:?}");
    }

    #[test]
    fn bad_streams_get_errors() {
        let mut frames = InboundFrames::new(100);
        frames.push(Bytes::from_static(&[0, 0, 0, 1, 0]));
        let e = frames.next_message().unwrap_err();
        assert!(e.to_string().contains("message length too large: found 256 bytes"), "{e}");

        let mut frames = InboundFrames::new(100);
        frames.push(Bytes::from_static(&[1, 0, 0, 0, 1, 0]));
        assert!(matches!(frames.next_message(), Err(InboundError::Compressed)));

        let mut frames = InboundFrames::new(100);
        frames.push(Bytes::from_static(&[0, 0, 0, 0, 4, 0x1a]));
        assert!(frames.next_message().unwrap().is_none());
        assert!(matches!(frames.finish(), Err(InboundError::Truncated(6))));

        let mut frames = InboundFrames::new(100);
        frames.push(Bytes::from_static(&[0, 0, 0, 0, 2, 0xff, 0xff]));
        assert!(matches!(frames.next_message(), Err(InboundError::Decode(_))));
    }

    #[test]
    fn the_inbound_side_reads_what_the_outbound_side_writes() {
        let data = Bytes::from(vec![7u8; 70_000]);
        let m = pb::TargetMessage { msg: Some(Msg::Chunk(pb::BatchChunk { batch_id: 9, index: 4, data })) };
        let mut frames = InboundFrames::new(1 << 20);
        let (a, b) = grpc_pieces(m).split();
        frames.push(a);
        frames.push(b.expect("a chunk has two pieces"));
        match frames.next_message().unwrap() {
            Some(Inbound::Chunk(c)) => {
                assert_eq!((c.batch_id, c.index, c.len()), (9, 4, 70_000));
                assert!(c.parts.iter().all(|p| p.iter().all(|&x| x == 7)));
            }
            other => panic!("{other:?}"),
        }
    }
}
