//! Fuzzing of everything the drafter reads off the network before it trusts
//! it: the frame cutter, the chunk assembler, and the decoding of hellos
//! and batch headers. Random inputs (DFLASH_FUZZ_CASES per property, 2000
//! by default) may be refused, never panic, and never make the parser take
//! more memory than its limits; well-formed batches survive being cut at
//! any byte. Each property prints how many inputs it tried.

#![allow(clippy::unwrap_used)] // tests panic on failure by design

use bytes::Bytes;
use dflash_fuzz::fuzz;
use dflash_proto as pb;
use dflash_proto::target_message::Msg;
use dflash_wire::{
    Assembled, Assembler, BatchMeta, DType, HostBatch, Inbound, InboundFrames, Layout, batch_messages, grpc_pieces,
};
use proptest::prelude::*;
use prost::Message;

/// Cuts `bytes` at the given offsets into frames.
fn frames(bytes: &[u8], cuts: &[usize]) -> Vec<Bytes> {
    let mut at: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
    at.sort_unstable();
    at.dedup();
    let mut out = Vec::new();
    let mut last = 0;
    for c in at.into_iter().chain([bytes.len()]) {
        out.push(Bytes::copy_from_slice(&bytes[last..c]));
        last = c;
    }
    out
}

/// Feeds one message to an assembler the way the drafter's landing does.
fn feed(asm: &mut Assembler, m: Inbound) -> Result<Assembled, dflash_wire::WireError> {
    match m {
        Inbound::Chunk(c) => asm.push_parts(c.batch_id, c.index, &c.parts),
        Inbound::Message(pb::TargetMessage { msg: Some(Msg::Header(h)) }) => asm.push_header(h),
        Inbound::Message(pb::TargetMessage { msg: Some(Msg::Chunk(c)) }) => asm.push_chunk(c),
        Inbound::Message(pb::TargetMessage { msg: Some(Msg::End(e)) }) => asm.push_end(e),
        Inbound::Message(_) => Ok(Assembled::Pending),
    }
}

/// A small valid batch of `tokens` tokens, `k` layers of width `h`.
fn batch(tokens: usize, k: usize, h: usize) -> HostBatch {
    let meta = BatchMeta {
        batch_id: 5,
        epoch: 0,
        target_instance: "t".into(),
        layout: Layout::Split,
        dtype: DType::F32,
        seq_lengths: vec![tokens as u32],
        input_ids: (0..tokens as u32).collect(),
        loss_mask: vec![1; tokens],
        layer_ids: (0..k as u32).collect(),
        hidden_size: h as u32,
        sample_ids: vec![1],
        target_top_k: 0,
        trace_context: Default::default(),
        lease_token: Vec::new(),
    };
    let payload: Vec<u8> = (0..meta.payload_bytes()).map(|i| (i * 7 % 251) as u8).collect();
    HostBatch::new(meta, payload.into()).unwrap()
}

/// The bytes a target sends for `b` (a hello first), chunks of `chunk` bytes.
fn stream_bytes(b: &HostBatch, chunk: usize, instance: &str) -> Vec<u8> {
    let hello = pb::TargetMessage {
        msg: Some(Msg::Hello(pb::StreamHello {
            protocol_version: 1,
            run_id: "run".into(),
            target_instance: instance.into(),
        })),
    };
    std::iter::once(hello)
        .chain(batch_messages(b, chunk))
        .flat_map(|m| {
            let (head, payload) = grpc_pieces(m).split();
            [head.to_vec(), payload.map(|p| p.to_vec()).unwrap_or_default()].concat()
        })
        .collect()
}

/// What the drafter's landing makes of `bytes` arriving in `frames`.
fn land(bytes: &[u8], cuts: &[usize], original: &HostBatch) -> &'static str {
    let mut f = InboundFrames::new(1 << 16);
    let mut asm = Assembler::new(1 << 16);
    let (mut outcome, mut refused) = ("incomplete", false);
    'frames: for frame in frames(bytes, cuts) {
        f.push(frame);
        loop {
            match f.next_message() {
                Ok(Some(Inbound::Message(pb::TargetMessage { msg: Some(Msg::Hello(h)) }))) => {
                    if dflash_proto::check_instance_id(&h.target_instance).is_err() {
                        outcome = "hello refused";
                        refused = true;
                        break 'frames;
                    }
                }
                Ok(Some(m)) => match feed(&mut asm, m) {
                    Ok(Assembled::Batch(done)) => {
                        // The CRC guards the payload: whatever got through is what was sent.
                        assert_eq!(done.payload, original.payload, "a payload that passed its CRC is the one sent");
                        outcome =
                            if done.meta == original.meta { "assembled intact" } else { "assembled, header changed" };
                    }
                    Ok(_) => {}
                    Err(_) => {
                        asm.reset();
                        outcome = "batch refused";
                        refused = true;
                    }
                },
                Ok(None) => break,
                Err(_) => {
                    outcome = "stream refused";
                    refused = true;
                    break 'frames;
                }
            }
        }
    }
    if !refused && f.finish().is_err() {
        outcome = "stream cut short";
    }
    outcome
}

#[test]
fn the_landing_takes_any_bytes() {
    // Pure noise.
    let noise = (prop::collection::vec(any::<u8>(), 0..3000), prop::collection::vec(any::<usize>(), 0..8));
    let b = batch(4, 1, 4);
    fuzz("landing, random bytes", 2000, noise, |(bytes, cuts)| land(&bytes, &cuts, &b));
    // Real streams with bytes overwritten, dropped or the stream cut short:
    // every branch of the frame cutter, the decoder and the assembler.
    let damaged = (
        1usize..24,
        1usize..3,
        1usize..8,
        1usize..200,
        prop::collection::vec((any::<usize>(), any::<u8>()), 0..4),
        prop::option::weighted(0.2, any::<usize>()),
        prop::collection::vec(any::<usize>(), 0..6),
        prop_oneof![6 => Just("t".to_string()), 1 => Just("a\nforged log line".to_string()), 1 => Just("nul\0".to_string()), 1 => "\\PC{0,80}"],
    );
    fuzz("landing, real streams damaged", 2000, damaged, |(tokens, k, h, chunk, edits, cut, cuts, instance)| {
        let b = batch(tokens, k, h);
        let mut bytes = stream_bytes(&b, chunk, &instance);
        for (at, v) in edits {
            let i = at % bytes.len();
            bytes[i] = v;
        }
        if let Some(c) = cut {
            bytes.truncate(c % (bytes.len() + 1));
        }
        land(&bytes, &cuts, &b)
    });
}

#[test]
fn batch_headers_are_checked_field_by_field() {
    // A consistent header with one field set to a random value.
    let field = (0usize..9, any::<u64>(), prop::collection::vec(any::<u32>(), 0..6));
    fuzz("batch headers, one field random", 2000, field, |(which, x, xs)| {
        let b = batch(6, 2, 4);
        let mut h = match batch_messages(&b, 1 << 20).next().unwrap().msg {
            Some(Msg::Header(h)) => h,
            other => panic!("a batch starts with its header, not {other:?}"),
        };
        match which {
            0 => h.layout = x as i32,
            1 => h.dtype = x as i32,
            2 => h.token_count = x as u32,
            3 => h.seq_lengths = xs.clone(),
            4 => h.input_ids = xs.clone(),
            5 => h.layer_ids = xs.clone(),
            6 => h.hidden_size = x as u32,
            7 => h.payload_bytes = x,
            _ => h.loss_mask = xs.iter().map(|&v| v as u8).collect::<Vec<u8>>().into(),
        }
        let meta = BatchMeta::from_header(h.clone());
        if let Ok(meta) = &meta {
            assert_eq!(meta.token_count(), h.input_ids.len());
            assert_eq!(meta.token_count(), h.seq_lengths.iter().map(|&l| l as usize).sum::<usize>());
            assert_eq!(meta.loss_mask.len(), meta.token_count());
            assert_eq!(meta.payload_bytes() as u64, h.payload_bytes);
        }
        match (meta.is_ok(), Assembler::new(1 << 16).push_header(h).is_ok()) {
            (true, true) => "taken",
            (false, false) => "refused",
            (true, false) => "consistent, but over the assembler's limit",
            (false, true) => panic!("the assembler took a header the decoder refuses"),
        }
    });
}

#[test]
fn well_formed_batches_survive_being_cut_at_any_byte() {
    let input = (1usize..40, 1usize..4, 1usize..12, 1usize..600, prop::collection::vec(any::<usize>(), 0..12));
    fuzz("framed batches, random cuts and chunk sizes", 2000, input, |(tokens, k, h, chunk, cuts)| {
        let b = batch(tokens, k, h);
        let outcome = land(&stream_bytes(&b, chunk, "t"), &cuts, &b);
        assert_eq!(outcome, "assembled intact");
        outcome
    });
}

#[test]
fn random_protobuf_bytes_never_reach_the_assembler_as_trusted_sizes() {
    // A header that claims a huge payload is refused before any buffer is taken.
    let h = pb::BatchHeader {
        batch_id: 1,
        token_count: u32::MAX,
        seq_lengths: vec![u32::MAX],
        input_ids: vec![],
        hidden_size: u32::MAX,
        layer_ids: vec![0],
        ..Default::default()
    };
    assert!(Assembler::new(1 << 20).push_header(h.clone()).is_err());
    let bytes = pb::TargetMessage { msg: Some(Msg::Header(h)) }.encode_to_vec();
    assert!(pb::TargetMessage::decode(bytes.as_slice()).is_ok());
}
