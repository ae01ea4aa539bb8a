//! A target instance split over several devices (pipeline parts of
//! consecutive layers) against the same model whole: two and three CPU
//! parts give the captured layers, the distillation top-k and the decoded
//! logits of one unsplit instance, bit for bit (the same kernels run on
//! the same values; only where the layers live changes), for a dense, an
//! MoE and a hybrid fixture on packed batches of several sequences. The
//! placement a device group gets is planned from the checkpoint's headers.

#![allow(clippy::unwrap_used)] // tests panic on failure by design

use std::path::PathBuf;

use dflash_models::placement::{Footprint, Placement};
use dflash_models::{LoadScope, TargetModel};
use tch::{Device, Kind, Tensor};

fn fixture(name: &str) -> PathBuf {
    std::env::var_os("DFLASH_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures"))
        .join(name)
}

/// A dense (tied head), a dense untied with several shards, an MoE and a
/// hybrid (linear-attention layers) fixture.
const SPLIT: &[&str] = &["tiny-llama", "tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen3.5-moe", "tiny-qwen3-next"];

fn planned(name: &str, parts: usize, scope: LoadScope) -> Placement {
    let inspection = TargetModel::inspect(&fixture(name), Kind::Float, scope).unwrap();
    let f = Footprint { workspace: 0, captures: Vec::new(), ..inspection.footprint };
    Placement::plan(&vec![Device::Cpu; parts], &f, None).unwrap()
}

fn assert_same(got: &Tensor, want: &Tensor, what: &str) {
    assert_eq!(got.size(), want.size(), "{what}: shape");
    assert!(got.equal(want), "{what}: max |diff| {}", (got - want).abs().max().double_value(&[]));
}

/// Packed sequences of several lengths from a fixed draw.
fn packed_ids(vocab: i64, lens: &[i64]) -> Tensor {
    tch::manual_seed(3);
    Tensor::randint(vocab, [lens.iter().sum::<i64>()], (Kind::Int64, Device::Cpu))
}

#[test]
fn a_target_split_over_cpu_parts_captures_and_decodes_exactly_as_the_whole() {
    for &name in SPLIT {
        let dir = fixture(name);
        let whole = TargetModel::load(&dir, Device::Cpu, Kind::Float, LoadScope::Full).unwrap();
        let n = whole.config.num_layers;
        let all: Vec<i64> = (0..n).collect();
        let lens = [37i64, 5, 70, 1, 20];
        let ids = packed_ids(whole.config.vocab_size, &lens);
        let (want_layers, want_top) = whole.capture_packed_with_top_k(&ids, &lens, &all, 4);
        for parts in [2usize, 3].into_iter().filter(|&p| p as i64 <= n) {
            let plan = planned(name, parts, LoadScope::Full);
            assert_eq!(plan.parts().len(), parts);
            assert_eq!(plan.parts().last().unwrap().layers.end, n, "{name}: every layer placed");
            let split = TargetModel::load_placed(&dir, &plan, Kind::Float, LoadScope::Full).unwrap();
            let what = format!("{name} in {parts} parts");
            // What serving ships: each capture on the device of its part.
            let (layers, top) = split.capture_packed_in_place(&ids, &lens, &all, 4);
            let top = top.expect("a top-k was asked for");
            assert_eq!(layers.len(), want_layers.len());
            for (l, (got, want)) in layers.iter().zip(&want_layers).enumerate() {
                assert_same(got, want, &format!("{what}: captured layer {l}"));
            }
            assert_same(&top.ids, &want_top.ids, &format!("{what}: top-k ids"));
            assert_same(&top.log_probs, &want_top.log_probs, &format!("{what}: top-k log-probabilities"));
            // Captures of a few layers only, stopping early (capture scope).
            let some = [0i64, n - 1];
            let capture = planned(name, parts, LoadScope::CaptureUpTo { last_layer: n - 1 });
            let short =
                TargetModel::load_placed(&dir, &capture, Kind::Float, LoadScope::CaptureUpTo { last_layer: n - 1 })
                    .unwrap();
            for (got, want) in
                short.capture_packed(&ids, &lens, &some).iter().zip(whole.capture_packed(&ids, &lens, &some))
            {
                assert_same(got, &want, &format!("{what}: capture scope"));
            }
            // Cached decoding: a prefill then one step, logits and a layer.
            let decode = |t: &TargetModel| {
                let mut cache = t.new_cache(1);
                let prompt = ids.narrow(0, 0, 37).view([1, 37]);
                let valid = Tensor::ones([1, 38], (Kind::Bool, Device::Cpu));
                let pos = Tensor::arange(37, (Kind::Int64, Device::Cpu)).view([1, 37]);
                let (h, c1) = t.forward_cached(&prompt, &pos, &valid.narrow(1, 0, 37), &mut cache, &[1]);
                let next = ids.narrow(0, 37, 1).view([1, 1]);
                let (h2, c2) =
                    t.forward_cached(&next, &Tensor::from_slice(&[37i64]).view([1, 1]), &valid, &mut cache, &[1]);
                (t.logits(&h), t.logits(&h2), c1, c2)
            };
            let (a, b) = (decode(&whole), decode(&split));
            assert_same(&b.0, &a.0, &format!("{what}: prefill logits"));
            assert_same(&b.1, &a.1, &format!("{what}: step logits"));
            assert_same(&b.2[0], &a.2[0], &format!("{what}: prefill layer 1"));
            assert_same(&b.3[0], &a.3[0], &format!("{what}: step layer 1"));
        }
    }
}

#[test]
fn a_placement_that_does_not_match_the_model_is_refused() {
    let dir = fixture("tiny-llama");
    let short = Placement::whole(Device::Cpu, 1);
    let err = TargetModel::load_placed(&dir, &short, Kind::Float, LoadScope::Full).err().unwrap().to_string();
    assert!(err.contains("holds 1 layers"), "{err}");
}
