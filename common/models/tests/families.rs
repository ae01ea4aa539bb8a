//! Llama, Qwen2 and Qwen3 targets against Hugging Face transformers: the
//! tiny fixtures in tests/fixtures (random weights, sharded and tied
//! variants) must give the logits and residual streams transformers gives
//! (tests/fixtures/golden.json, made by tests/fixtures/golden.py).

#![allow(clippy::unwrap_used)] // tests panic on failure by design

use std::path::PathBuf;

use dflash_models::{LoadScope, ModelError, TargetModel};
use tch::{Device, Kind, Tensor};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn golden() -> serde_json::Value {
    let text = std::fs::read_to_string(fixtures().join("golden.json")).expect("tests/fixtures/golden.json");
    serde_json::from_str(&text).expect("golden json")
}

fn matrix(v: &serde_json::Value) -> Tensor {
    let rows: Vec<Vec<f64>> = serde_json::from_value(v.clone()).expect("matrix");
    let flat: Vec<f64> = rows.iter().flatten().copied().collect();
    Tensor::from_slice(&flat).view([rows.len() as i64, -1])
}

fn max_rel_err(got: &Tensor, want: &Tensor) -> f64 {
    ((got.to_kind(Kind::Double) - want).abs().max() / want.abs().max()).double_value(&[])
}

#[test]
fn targets_match_transformers() {
    let g = golden();
    let ids: Vec<i64> = serde_json::from_value(g["ids"].clone()).unwrap();
    let n = ids.len() as i64;
    for name in ["tiny-llama", "tiny-qwen2", "tiny-qwen3"] {
        let t = TargetModel::load(&fixtures().join(name), Device::Cpu, Kind::Float, LoadScope::Full).unwrap();
        // Cached forward over the whole prompt (the decoding path).
        let mut cache = t.new_cache(1);
        let idt = Tensor::from_slice(&ids).view([1, n]);
        let pos = Tensor::arange(n, (Kind::Int64, Device::Cpu)).unsqueeze(0);
        let valid = Tensor::ones([1, n], (Kind::Bool, Device::Cpu));
        let (h, feats) = t.forward_cached(&idt, &pos, &valid, &mut cache, &[0, 1]);
        let logits = t.logits(&h).squeeze_dim(0);
        let err = max_rel_err(&logits, &matrix(&g[name]["logits"]));
        assert!(err < 1e-5, "{name}: logits differ from transformers by {err}");
        // Packed capture (the training path): two copies of the prompt.
        let packed = Tensor::from_slice(&[ids.clone(), ids.clone()].concat());
        let cap = t.capture_packed(&packed, &[n, n], &[0, 1]);
        // transformers' last hidden state is after the final norm; the
        // residual stream after layer 0 is a plain capture point.
        let want = matrix(&g[name]["hidden_after_layer_0"]);
        assert!(max_rel_err(&feats[0].squeeze_dim(0), &want) < 1e-5, "{name} layer 0 (cached)");
        assert!(max_rel_err(&cap[0].narrow(0, n, n), &want) < 1e-5, "{name} layer 0 (packed)");
        assert!(max_rel_err(&cap[1].narrow(0, n, n), &feats[1].squeeze_dim(0).to_kind(Kind::Double)) < 1e-5);
    }
}

#[test]
fn missing_tensors_and_unsupported_architectures_are_named() {
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json"] {
        std::fs::copy(fixtures().join("tiny-qwen3").join(f), dir.path().join(f)).unwrap();
    }
    // The second shard is gone: the index still names it.
    let err = TargetModel::load(dir.path(), Device::Cpu, Kind::Float, LoadScope::Full).err().unwrap();
    assert!(matches!(err, ModelError::Io { .. }), "{err}");
    assert!(err.to_string().contains("model-00002-of-00002.safetensors"), "{err}");

    let text = std::fs::read_to_string(dir.path().join("config.json")).unwrap();
    std::fs::write(dir.path().join("config.json"), text.replace("Qwen3ForCausalLM", "GPT2LMHeadModel")).unwrap();
    let err = TargetModel::load(dir.path(), Device::Cpu, Kind::Float, LoadScope::Full).err().unwrap();
    assert!(err.to_string().contains("GPT2LMHeadModel") && err.to_string().contains("not supported"), "{err}");
}

#[test]
fn bf16_weights_load_and_agree_with_f32() {
    let t32 = TargetModel::load(&fixtures().join("tiny-qwen3"), Device::Cpu, Kind::Float, LoadScope::Full).unwrap();
    let t16 = TargetModel::load(&fixtures().join("tiny-qwen3"), Device::Cpu, Kind::BFloat16, LoadScope::Full).unwrap();
    let ids = Tensor::from_slice(&[5i64, 6, 7, 8]);
    let a = t32.capture_packed(&ids, &[4], &[1]);
    let b = t16.capture_packed(&ids, &[4], &[1]);
    assert_eq!(b[0].kind(), Kind::BFloat16);
    let err = max_rel_err(&b[0], &a[0].to_kind(Kind::Double));
    assert!(err < 5e-2, "bf16 vs f32: {err}");
}

#[test]
fn drafter_can_start_from_the_targets_top_layers_and_final_norm() {
    use dflash_models::{Drafter, DrafterConfig, TargetConfig};
    let dir = fixtures().join("tiny-llama");
    let t = TargetConfig::from_dir(&dir).unwrap();
    let target: std::collections::HashMap<String, Tensor> =
        dflash_models::weights::Weights::load(&dir, Device::Cpu, Kind::Float, |_| true)
            .unwrap()
            .into_tensors()
            .into_iter()
            .collect();
    let mut d = Drafter::new(DrafterConfig::for_target(&t, 1, 4, 3, vec![1]), Device::Cpu, Kind::Float);
    let fc_before = d.named_parameters().into_iter().find(|(n, _)| n == "fc.weight").unwrap().1.copy();
    // norm + the 9 tensors of a Llama layer (no QK norms there).
    assert_eq!(d.init_from_target(&dir).unwrap(), 10);
    let p: std::collections::HashMap<String, Tensor> = d.named_parameters().into_iter().collect();
    let last = t.num_layers - 1;
    assert!(p["norm.weight"].equal(&target["model.norm.weight"]));
    assert!(
        p["layers.0.self_attn.q_proj.weight"].equal(&target[&format!("model.layers.{last}.self_attn.q_proj.weight")])
    );
    assert!(p["layers.0.mlp.down_proj.weight"].equal(&target[&format!("model.layers.{last}.mlp.down_proj.weight")]));
    assert!(p["fc.weight"].equal(&fc_before), "the fusion stays fresh");
}
