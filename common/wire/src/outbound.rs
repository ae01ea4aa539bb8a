//! The target's side of the hidden-state stream, below gRPC's message
//! layer: each message as the bytes of its gRPC framing, with a chunk's
//! payload passed along as the slice of the batch it already is.
//!
//! A generic gRPC client encodes every message into a buffer of its own,
//! a full copy of each 4 MiB chunk (into freshly allocated memory) before
//! the HTTP/2 layer writes it to the socket. Here a chunk becomes two
//! pieces: a few bytes of framing and protobuf keys, then the payload
//! itself; the socket write reads the payload where the batch holds it.

use bytes::{BufMut, Bytes, BytesMut};
use dflash_proto as pb;
use pb::target_message::Msg;
use prost::Message;
use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint, key_len};

/// The gRPC framing of `m`: one piece, or two for a chunk (head, payload).
/// The concatenation is exactly the bytes a generic encoder would send.
pub fn grpc_pieces(m: pb::TargetMessage) -> Pieces {
    match m.msg {
        Some(Msg::Chunk(c)) if !c.data.is_empty() => {
            let data_len = c.data.len();
            let mut inner = key_len(3) + encoded_len_varint(data_len as u64) + data_len;
            if c.batch_id != 0 {
                inner += key_len(1) + encoded_len_varint(c.batch_id);
            }
            if c.index != 0 {
                inner += key_len(2) + encoded_len_varint(u64::from(c.index));
            }
            let outer = key_len(3) + encoded_len_varint(inner as u64) + inner;
            let mut head = BytesMut::with_capacity(5 + outer - data_len);
            head.put_u8(0);
            head.put_u32(outer as u32);
            encode_key(3, WireType::LengthDelimited, &mut head);
            encode_varint(inner as u64, &mut head);
            if c.batch_id != 0 {
                encode_key(1, WireType::Varint, &mut head);
                encode_varint(c.batch_id, &mut head);
            }
            if c.index != 0 {
                encode_key(2, WireType::Varint, &mut head);
                encode_varint(u64::from(c.index), &mut head);
            }
            encode_key(3, WireType::LengthDelimited, &mut head);
            encode_varint(data_len as u64, &mut head);
            Pieces::Two(head.freeze(), c.data)
        }
        _ => Pieces::One(grpc_message(&m)),
    }
}

/// Any message with gRPC's prefix (uncompressed, big-endian length): the
/// framing of every message but a chunk's payload, in both directions.
pub fn grpc_message(m: &impl Message) -> Bytes {
    let len = m.encoded_len();
    let mut buf = BytesMut::with_capacity(5 + len);
    buf.put_u8(0);
    buf.put_u32(len as u32);
    m.encode(&mut buf).expect("the buffer has room for the message");
    buf.freeze()
}

/// One message's bytes on the wire, in order.
#[derive(Debug)]
pub enum Pieces {
    One(Bytes),
    Two(Bytes, Bytes),
}

impl Pieces {
    /// The first piece and what follows it, if anything.
    pub fn split(self) -> (Bytes, Option<Bytes>) {
        match self {
            Pieces::One(a) => (a, None),
            Pieces::Two(a, b) => (a, Some(b)),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// `m` framed as a generic gRPC encoder frames it (the reference for both directions).
    pub(crate) fn generic(m: &pb::TargetMessage) -> Vec<u8> {
        let body = m.encode_to_vec();
        let mut out = vec![0u8];
        out.extend_from_slice(&(body.len() as u32).to_be_bytes());
        out.extend_from_slice(&body);
        out
    }

    fn concat(p: Pieces) -> Vec<u8> {
        let (a, b) = p.split();
        [a.to_vec(), b.map(|b| b.to_vec()).unwrap_or_default()].concat()
    }

    #[test]
    fn pieces_are_the_bytes_a_generic_encoder_sends() {
        let payload = Bytes::from((0..300_000u32).map(|i| i as u8).collect::<Vec<u8>>());
        let cases = [
            (0, 0, payload.clone()),
            (1, 1, payload.slice(..1)),
            (u64::MAX, u32::MAX, payload.slice(..200)),
            (123_456_789, 70_000, payload.clone()),
            (5, 0, Bytes::new()),
        ];
        for (batch_id, index, data) in cases {
            let m = pb::TargetMessage { msg: Some(Msg::Chunk(pb::BatchChunk { batch_id, index, data: data.clone() })) };
            let pieces = grpc_pieces(m.clone());
            if let Pieces::Two(_, tail) = &pieces {
                assert_eq!(tail.as_ptr(), data.as_ptr(), "the payload is passed along, not copied");
            }
            assert_eq!(concat(pieces), generic(&m), "batch {batch_id} index {index}");
        }
        let end = pb::TargetMessage {
            msg: Some(Msg::End(pb::BatchEnd { batch_id: 3, chunk_count: 2, crc32c: 9, header_crc32c: 0 })),
        };
        assert_eq!(concat(grpc_pieces(end.clone())), generic(&end));
    }
}
