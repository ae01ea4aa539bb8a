//! Hidden-state batches on the wire.
//!
//! A target sends each batch as a header, data chunks and an end marker with
//! the CRC32C of the payload ([`batch_messages`]); the drafter reassembles and
//! verifies it ([`Assembler`]). Errors say whether a resend can help
//! ([`WireError::is_retryable`]). [`rpc`] carries the messages between the
//! two: the call, the service and their transport settings.

mod batch;
mod features;
mod inbound;
mod outbound;
pub mod rpc;
mod stream;

pub use batch::{BatchMeta, DType, HostBatch, Layout, distill_bytes};
pub use features::FeatureSpec;
pub use inbound::{ChunkParts, Inbound, InboundError, InboundFrames};
pub use outbound::{Pieces, grpc_message, grpc_pieces};
pub use stream::{Assembled, Assembler, PayloadBuffer, batch_messages};

/// What can be wrong with a batch on the wire.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// Damaged in transit (CRC mismatch, truncation, out-of-order chunk): resend.
    #[error("batch {batch_id} arrived corrupt: {what}")]
    Corrupt { batch_id: u64, what: String },
    /// The header contradicts itself; resending the same batch cannot help.
    #[error("batch {batch_id} has an invalid header: {what}")]
    InvalidHeader { batch_id: u64, what: String },
    #[error("batch {batch_id} payload of {bytes} bytes exceeds the limit of {limit} bytes")]
    TooLarge { batch_id: u64, bytes: usize, limit: usize },
    /// Messages in an order the protocol does not allow.
    #[error("protocol violation: {0}")]
    Protocol(String),
}

impl WireError {
    /// True when sending the same batch again may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(self, WireError::Corrupt { .. })
    }

    /// The batch the error is about, when known.
    pub fn batch_id(&self) -> Option<u64> {
        match self {
            WireError::Corrupt { batch_id, .. }
            | WireError::InvalidHeader { batch_id, .. }
            | WireError::TooLarge { batch_id, .. } => Some(*batch_id),
            WireError::Protocol(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use dflash_proto::target_message::Msg;

    fn batch(tokens: usize, k: usize, h: usize) -> HostBatch {
        with_top_k(tokens, k, h, 0)
    }

    fn with_top_k(tokens: usize, k: usize, h: usize, top_k: u32) -> HostBatch {
        let meta = BatchMeta {
            batch_id: 42,
            epoch: 1,
            target_instance: "t0".into(),
            layout: Layout::Split,
            dtype: DType::F32,
            seq_lengths: vec![tokens as u32 - 2, 2],
            input_ids: (0..tokens as u32).collect(),
            loss_mask: (0..tokens).map(|i| (i % 2) as u8).collect(),
            layer_ids: (0..k as u32).collect(),
            hidden_size: h as u32,
            sample_ids: vec![7, 9],
            target_top_k: top_k,
            trace_context: [("traceparent".to_string(), "00-ab-cd-01".to_string())].into(),
            lease_token: vec![9; 16],
        };
        let payload: Vec<u8> = (0..meta.payload_bytes()).map(|i| (i * 31 % 251) as u8).collect();
        HostBatch::new(meta, Bytes::from(payload)).unwrap()
    }

    fn assemble(asm: &mut Assembler, msgs: Vec<dflash_proto::TargetMessage>) -> Result<Option<HostBatch>, WireError> {
        let mut out = None;
        for m in msgs {
            let r = match m.msg.unwrap() {
                Msg::Header(h) => asm.push_header(h)?,
                Msg::Chunk(c) => asm.push_chunk(c)?,
                Msg::End(e) => asm.push_end(e)?,
                Msg::Hello(_) => unreachable!(),
            };
            if let Assembled::Batch(b) = r {
                out = Some(b);
            }
        }
        Ok(out)
    }

    fn messages_of(b: &HostBatch, chunk: usize) -> Vec<dflash_proto::TargetMessage> {
        batch_messages(b, chunk).collect()
    }

    #[test]
    fn a_batch_survives_the_byte_stream_in_frames_of_any_size() {
        // Target side: gRPC framing with zero-copy payloads; drafter side:
        // frames cut into messages, chunks assembled from their frames.
        let b = batch(1000, 2, 96);
        let stream: Vec<u8> = messages_of(&b, 300_000)
            .into_iter()
            .flat_map(|m| {
                let (head, payload) = grpc_pieces(m).split();
                [head.to_vec(), payload.map(|p| p.to_vec()).unwrap_or_default()].concat()
            })
            .collect();
        for frame in [7, 4096, 65_536, 1 << 20] {
            let (mut frames, mut asm, mut got) = (InboundFrames::new(1 << 20), Assembler::new(1 << 20), None);
            for f in stream.chunks(frame) {
                frames.push(Bytes::copy_from_slice(f));
                while let Some(m) = frames.next_message().unwrap() {
                    let r = match m {
                        Inbound::Chunk(c) => asm.push_parts(c.batch_id, c.index, &c.parts),
                        Inbound::Message(m) => match m.msg.unwrap() {
                            Msg::Header(h) => asm.push_header(h),
                            Msg::End(e) => asm.push_end(e),
                            other => panic!("unexpected {other:?}"),
                        },
                    };
                    if let Assembled::Batch(done) = r.unwrap() {
                        got = Some(done);
                    }
                }
            }
            frames.finish().unwrap();
            let got = got.expect("the batch was assembled");
            assert_eq!((got.payload, got.meta.batch_id), (b.payload.clone(), b.meta.batch_id), "frames of {frame}");
        }
    }

    #[test]
    fn large_chunks_land_in_pieces_with_the_same_crc() {
        // 1000 tokens x 2 layers x 96 x 4 bytes = 768,000 bytes: chunks of
        // 300,000 bytes span several landing steps and end mid-step.
        let b = batch(1000, 2, 96);
        let m = messages_of(&b, 300_000);
        assert_eq!(m.len(), 5);
        match &m[4].msg {
            Some(Msg::End(e)) => assert_eq!(e.crc32c, crc32c::crc32c(&b.payload)),
            other => panic!("expected the end marker, got {other:?}"),
        }
        let got = assemble(&mut Assembler::new(1 << 20), m).unwrap().unwrap();
        assert_eq!(got.payload, b.payload);
    }

    #[test]
    fn a_header_changed_in_flight_is_caught_at_the_end_and_resent() {
        let b = batch(37, 3, 16);
        // Changes that keep the header consistent (the payload's size and
        // CRC stay right): a token id, a loss-mask byte, a sample id, the
        // lease token. The trace context is not covered (a hop may rewrite it).
        let edits: [fn(&mut dflash_proto::BatchHeader); 5] = [
            |h| h.input_ids[3] += 1,
            |h| h.loss_mask = h.loss_mask.iter().map(|&m| 1 - m).collect::<Vec<u8>>().into(),
            |h| h.sample_ids[1] = 8,
            |h| h.lease_token = vec![1u8; 16].into(),
            |h| h.epoch = 2,
        ];
        for edit in edits {
            let mut msgs = messages_of(&b, 1000);
            if let Some(Msg::Header(h)) = &mut msgs[0].msg {
                edit(h);
            }
            let err = assemble(&mut Assembler::new(1 << 20), msgs).unwrap_err();
            assert!(err.is_retryable() && err.to_string().contains("header CRC32C"), "{err}");
        }
        let mut msgs = messages_of(&b, 1000);
        if let Some(Msg::Header(h)) = &mut msgs[0].msg {
            h.trace_context.insert("tracestate".into(), "x=1".into());
        }
        assert!(assemble(&mut Assembler::new(1 << 20), msgs).unwrap().is_some(), "the trace context may change");
    }

    #[test]
    fn bytes_round_trip_through_chunks() {
        let b = batch(37, 3, 16);
        let msgs = messages_of(&b, 1000);
        // 37*3*16*4 = 7104 bytes -> 8 chunks + header + end
        assert_eq!(msgs.len(), 10);
        let got = assemble(&mut Assembler::new(1 << 20), msgs).unwrap().unwrap();
        assert_eq!(got.meta, b.meta);
        assert_eq!(got.payload, b.payload);

        // With distillation targets: 37*5*8 = 1480 bytes more, one chunk more.
        let b = with_top_k(37, 3, 16, 5);
        assert_eq!((b.meta.feature_bytes(), b.meta.distill_bytes()), (7104, 1480));
        let msgs = messages_of(&b, 1000);
        assert_eq!(msgs.len(), 11);
        let got = assemble(&mut Assembler::new(1 << 20), msgs).unwrap().unwrap();
        assert_eq!((got.meta.target_top_k, &got.payload), (5, &b.payload));
        assert_eq!(got.meta, b.meta);

        // More than any run ships: refused before its size is computed.
        let mut h = with_top_k(37, 3, 16, 5).meta.to_header();
        h.target_top_k = u32::MAX;
        let err = BatchMeta::from_header(h).unwrap_err().to_string();
        assert!(err.contains("top-4294967295 distillation targets; at most 1024"), "{err}");
    }

    #[test]
    fn flipped_bit_fails_the_crc_and_asks_for_resend() {
        let b = batch(37, 3, 16);
        let mut msgs = messages_of(&b, 1000);
        if let Some(Msg::Chunk(c)) = &mut msgs[3].msg {
            let mut d = c.data.to_vec();
            d[5] ^= 1;
            c.data = Bytes::from(d);
        }
        let err = assemble(&mut Assembler::new(1 << 20), msgs).unwrap_err();
        assert!(err.is_retryable(), "{err}");
        assert!(err.to_string().contains("CRC32C"), "{err}");
    }

    #[test]
    fn truncated_and_reordered_chunks_are_detected() {
        let b = batch(37, 3, 16);
        let mut msgs = messages_of(&b, 1000);
        msgs.remove(4);
        let err = assemble(&mut Assembler::new(1 << 20), msgs).unwrap_err();
        assert!(err.is_retryable() && err.to_string().contains("chunk 4 arrived where chunk 3"), "{err}");

        let mut msgs = messages_of(&b, 1000);
        let n = msgs.len();
        msgs.remove(n - 2); // last chunk
        let err = assemble(&mut Assembler::new(1 << 20), msgs).unwrap_err();
        assert!(err.to_string().contains("truncated"), "{err}");
    }

    #[test]
    fn oversized_and_inconsistent_headers_are_rejected() {
        let b = batch(37, 3, 16);
        let err = assemble(&mut Assembler::new(1000), messages_of(&b, 1000)).unwrap_err();
        assert!(matches!(err, WireError::TooLarge { .. }), "{err}");

        let mut msgs = messages_of(&b, 1000);
        if let Some(Msg::Header(h)) = &mut msgs[0].msg {
            h.seq_lengths = vec![30, 2];
        }
        let err = assemble(&mut Assembler::new(1 << 20), msgs).unwrap_err();
        assert!(!err.is_retryable() && err.to_string().contains("sum to 32"), "{err}");
    }

    #[test]
    fn chunk_without_header_is_a_protocol_error() {
        let b = batch(37, 3, 16);
        let msgs = messages_of(&b, 1000).split_off(1);
        let err = assemble(&mut Assembler::new(1 << 20), msgs).unwrap_err();
        assert!(matches!(err, WireError::Protocol(_)), "{err}");
    }
}
