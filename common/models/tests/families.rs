//! Every target family against Hugging Face transformers: the tiny fixtures
//! in tests/fixtures (random weights; Llama with llama3 RoPE and biases,
//! Qwen2 with linear RoPE, Qwen3 with YaRN, Qwen3 MoE dense/sparse mixes,
//! FP8 block-quantized checkpoints; sharded and unsharded, tied and
//! untied; configs in the 4.x and the 5.x layout) must give the logits and
//! every layer's residual stream transformers gives, through the packed
//! capture path and the cached decoding path. The references
//! (`reference.safetensors` in each fixture) are made by
//! tests/fixtures/make_fixtures.py.

#![allow(clippy::unwrap_used)] // tests panic on failure by design

use std::path::{Path, PathBuf};

use dflash_models::{LoadScope, ModelError, TargetConfig, TargetModel};
use tch::{Device, Kind, Tensor};

/// Relative error allowed in f32 against transformers' float64 forward.
const TOLERANCE: f64 = 1e-5;

/// Every fixture; each must have a reference.
const FIXTURES: &[&str] = &[
    "tiny-llama",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-llama3",
    "tiny-llama3-tf4",
    "tiny-qwen3-tf5",
    "tiny-qwen3-yarn",
    "tiny-qwen2-linear",
    "tiny-qwen3-moe",
    "tiny-qwen3-moe-step2",
    "tiny-qwen3-fp8",
    "tiny-qwen3-moe-fp8",
    "tiny-qwen3-next",
    "tiny-qwen3.5",
    "tiny-qwen3.5-vl",
    "tiny-qwen3.5-moe",
    "tiny-qwen3.5-moe-vl",
    "tiny-gpt-oss",
    "tiny-gpt-oss-mxfp4",
    "tiny-deepseek-v3",
    "tiny-deepseek-v3-fp8",
    "tiny-moonlight",
    "tiny-glm4-moe",
];

/// The fixtures folder (`DFLASH_FIXTURES` where the test binary runs away
/// from the tree it was built in, e.g. on a GPU host).
fn fixtures() -> PathBuf {
    std::env::var_os("DFLASH_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures"))
}

/// A fixture's reference: prompt ids, logits `[n, vocab]`, layer outputs.
struct Reference {
    ids: Vec<i64>,
    logits: Tensor,
    hidden: Vec<Tensor>,
}

fn reference(dir: &Path) -> Reference {
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let get = |name: &str| {
        let v = st.tensor(name).unwrap();
        let kind = if name == "ids" { Kind::Int64 } else { Kind::Float };
        let shape: Vec<i64> = v.shape().iter().map(|&d| d as i64).collect();
        Tensor::f_from_data_size(v.data(), &shape, kind).unwrap()
    };
    let n_layers = st.names().iter().filter(|n| n.starts_with("hidden.")).count();
    Reference {
        ids: Vec::<i64>::try_from(get("ids")).unwrap(),
        logits: get("logits"),
        hidden: (0..n_layers).map(|i| get(&format!("hidden.{i}"))).collect(),
    }
}

fn max_rel_err(got: &Tensor, want: &Tensor) -> f64 {
    let got = got.to_kind(Kind::Double);
    let want = want.to_kind(Kind::Double);
    ((got - &want).abs().max() / want.abs().max()).double_value(&[])
}

#[test]
fn every_family_matches_transformers_through_capture_and_decoding() {
    let mut checked = Vec::new();
    for name in FIXTURES {
        let dir = fixtures().join(name);
        let r = reference(&dir);
        let n = r.ids.len() as i64;
        let t = TargetModel::load(&dir, Device::Cpu, Kind::Float, LoadScope::Full).unwrap();
        let all: Vec<i64> = (0..t.config.num_layers).collect();
        assert_eq!(r.hidden.len() as i64, t.config.num_layers, "{name}");

        // The decoding path: a cached forward over the whole prompt.
        let mut cache = t.new_cache(1);
        let idt = Tensor::from_slice(&r.ids).view([1, n]);
        let pos = Tensor::arange(n, (Kind::Int64, Device::Cpu)).unsqueeze(0);
        let valid = Tensor::ones([1, n], (Kind::Bool, Device::Cpu));
        let (h, cached) = t.forward_cached(&idt, &pos, &valid, &mut cache, &all);
        let err = max_rel_err(&t.logits(&h).squeeze_dim(0), &r.logits);
        assert!(err < TOLERANCE, "{name}: logits differ from transformers by {err}");

        // The training path: packed with a shorter sequence in front of it
        // (whose states are the prompt's prefix: attention is causal).
        let prefix = 17;
        let packed = Tensor::from_slice(&[&r.ids[..prefix as usize], &r.ids[..]].concat());
        let captured = t.capture_packed(&packed, &[prefix, n], &all);
        for (l, want) in r.hidden.iter().enumerate() {
            let err = max_rel_err(&cached[l].squeeze_dim(0), want);
            assert!(err < TOLERANCE, "{name} layer {l} (cached): {err}");
            let err = max_rel_err(&captured[l].narrow(0, prefix, n), want);
            assert!(err < TOLERANCE, "{name} layer {l} (packed): {err}");
            let err = max_rel_err(&captured[l].narrow(0, 0, prefix), &want.narrow(0, 0, prefix));
            assert!(err < TOLERANCE, "{name} layer {l} (packed prefix): {err}");
        }

        // Distillation targets: the packed path continued through the final
        // norm and LM head picks transformers' top-8 next tokens at every
        // position of the prompt, with transformers' log-probabilities
        // (compared by value, so a near-tie may order two ids either way).
        let (_, top) = t.capture_packed_with_top_k(&packed, &[prefix, n], &[0], 8);
        let want_lp = r.logits.log_softmax(-1, Kind::Float);
        let (want_top, _) = want_lp.topk(8, -1, true, true);
        let (ids, got) = (top.ids.narrow(0, prefix, n).to_kind(Kind::Int64), top.log_probs.narrow(0, prefix, n));
        let at_ids = want_lp.gather(1, &ids, false);
        for (what, x) in [("ranked values", &want_top), ("their ids' values", &at_ids)] {
            let err = (&got - x).abs().max().double_value(&[]);
            assert!(err < 1e-4, "{name}: top-k log-probabilities differ from transformers' {what} by {err}");
        }
        checked.push(*name);
    }
    assert_eq!(checked.len(), FIXTURES.len());
}

/// The hybrid fixtures (Gated DeltaNet layers keep a convolution window
/// and a recurrent state in the cache).
const HYBRIDS: &[&str] =
    &["tiny-qwen3-next", "tiny-qwen3.5", "tiny-qwen3.5-vl", "tiny-qwen3.5-moe", "tiny-qwen3.5-moe-vl"];

/// Runs `ids` through the cache in pieces of the given sizes; returns the
/// logits of every position.
fn decode_in_pieces(t: &TargetModel, ids: &[i64], pieces: &[usize]) -> Tensor {
    let mut cache = t.new_cache(1);
    let mut out = Vec::new();
    let mut at = 0usize;
    for &n in pieces {
        let chunk = Tensor::from_slice(&ids[at..at + n]).view([1, n as i64]);
        let pos = (Tensor::arange(n as i64, (Kind::Int64, Device::Cpu)) + at as i64).unsqueeze(0);
        let valid = Tensor::ones([1, (at + n) as i64], (Kind::Bool, Device::Cpu));
        let (h, _) = t.forward_cached(&chunk, &pos, &valid, &mut cache, &[]);
        out.push(t.logits(&h).squeeze_dim(0));
        at += n;
    }
    Tensor::cat(&out, 0)
}

/// Decodes `ids[..prefix]`, then a verified block of `ids[prefix..kept]`
/// followed by `wrong` wrong guesses, goes back to `kept` and decodes
/// `ids[kept..end]`: the logits of those last tokens.
fn after_rejected_draft(t: &TargetModel, ids: &[i64], prefix: usize, kept: usize, wrong: usize, end: usize) -> Tensor {
    let run = |cache: &mut dflash_models::KvCache, from: usize, ids: &[i64]| {
        let n = ids.len() as i64;
        let pos = (Tensor::arange(n, (Kind::Int64, Device::Cpu)) + from as i64).unsqueeze(0);
        let valid = Tensor::ones([1, from as i64 + n], (Kind::Bool, Device::Cpu));
        let (h, _) = t.forward_cached(&Tensor::from_slice(ids).view([1, n]), &pos, &valid, cache, &[]);
        t.logits(&h).squeeze_dim(0)
    };
    let mut cache = t.new_cache(1);
    let _ = run(&mut cache, 0, &ids[..prefix]);
    let mut guess = ids[prefix..kept].to_vec();
    guess.extend(std::iter::repeat_n(3i64, wrong));
    let _ = run(&mut cache, prefix, &guess);
    cache.truncate(kept as i64);
    run(&mut cache, kept, &ids[kept..end])
}

/// `ids[..long]` and a left-padded `ids[..short]` prefilled in one batch,
/// then each row's next token: the last prefill position's logits and the
/// step's, `[2, vocab]` each.
fn left_padded_pair(t: &TargetModel, ids: &[i64], long: i64, short: i64) -> (Tensor, Tensor) {
    let pad = long - short;
    let mut batch = ids[..long as usize].to_vec();
    batch.extend(std::iter::repeat_n(0, pad as usize));
    batch.extend_from_slice(&ids[..short as usize]);
    let batch = Tensor::from_slice(&batch).view([2, long]);
    let b = (Kind::Bool, Device::Cpu);
    let valid = Tensor::cat(
        &[Tensor::ones([1, long], b), Tensor::cat(&[Tensor::zeros([1, pad], b), Tensor::ones([1, short], b)], 1)],
        0,
    );
    let pos = (valid.to_kind(Kind::Int64).cumsum(1, Kind::Int64) - 1).clamp_min(0);
    let mut cache = t.new_cache(2);
    let (h, _) = t.forward_cached(&batch, &pos, &valid, &mut cache, &[]);
    let first = t.logits(&h.select(1, long - 1));
    let step = Tensor::from_slice(&[ids[long as usize], ids[short as usize]]).view([2, 1]);
    let valid = Tensor::cat(&[valid, Tensor::ones([2, 1], b)], 1);
    let (h2, _) = t.forward_cached(&step, &Tensor::from_slice(&[long, short]).view([2, 1]), &valid, &mut cache, &[]);
    (first, t.logits(&h2.select(1, 0)))
}

#[test]
fn hybrid_decoding_step_by_step_and_through_rejected_blocks_equals_the_full_forward() {
    for name in HYBRIDS {
        let dir = fixtures().join(name);
        let r = reference(&dir);
        let t = TargetModel::load(&dir, Device::Cpu, Kind::Float, LoadScope::Full).unwrap();
        // A prefill, single tokens (the recurrence), then short blocks (chunks).
        let pieces = [70usize, 1, 1, 1, 16, 1, 30, 30];
        let got = decode_in_pieces(&t, &r.ids, &pieces);
        let err = max_rel_err(&got, &r.logits);
        assert!(err < TOLERANCE, "{name}: decoded in pieces: {err}");

        // Speculative decoding's pattern: a block of 16 is verified and only
        // a prefix kept; the cache goes back to it and decoding continues.
        let next = after_rejected_draft(&t, &r.ids, 60, 65, 11, 90);
        let err = max_rel_err(&next, &r.logits.narrow(0, 65, 25));
        assert!(err < TOLERANCE, "{name}: after going back inside a verified block: {err}");
    }
}

#[test]
fn hybrid_batched_decoding_with_left_padding_equals_each_prompt_alone() {
    for name in HYBRIDS {
        let dir = fixtures().join(name);
        let r = reference(&dir);
        let t = TargetModel::load(&dir, Device::Cpu, Kind::Float, LoadScope::Full).unwrap();
        // Two prompts, the shorter left-padded, then two decode steps.
        let (long, short) = (90i64, 41i64);
        let (first, second) = left_padded_pair(&t, &r.ids, long, short);
        for (row, n) in [(0i64, long), (1, short)] {
            let err = max_rel_err(&first.get(row), &r.logits.get(n - 1));
            assert!(err < TOLERANCE, "{name}: row {row} prefill: {err}");
            let err = max_rel_err(&second.get(row), &r.logits.get(n));
            assert!(err < TOLERANCE, "{name}: row {row} after one step: {err}");
        }
    }
}

/// Fixtures whose attention is windowed, sinked or latent.
const ROUTED: &[&str] = &["tiny-gpt-oss", "tiny-deepseek-v3", "tiny-moonlight", "tiny-glm4-moe"];

/// Decoding over the cache (sliding windows of 8 counted over cached
/// positions, sinks in every softmax, latent attention's expanded keys) in
/// pieces, after a rejected draft, and left-padded in a batch gives the
/// full forward's logits.
#[test]
fn windowed_sinked_and_latent_decoding_in_pieces_and_batches_equals_the_full_forward() {
    for name in ROUTED {
        let dir = fixtures().join(name);
        let r = reference(&dir);
        let n = r.ids.len();
        let t = TargetModel::load(&dir, Device::Cpu, Kind::Float, LoadScope::Full).unwrap();
        let got = decode_in_pieces(&t, &r.ids, &[17, 1, 1, 8, 1, n - 28]);
        let err = max_rel_err(&got, &r.logits);
        assert!(err < TOLERANCE, "{name}: decoded in pieces: {err}");

        // A verified block of which only a prefix is kept.
        let next = after_rejected_draft(&t, &r.ids, 20, 23, 5, n);
        let err = max_rel_err(&next, &r.logits.narrow(0, 23, n as i64 - 23));
        assert!(err < TOLERANCE, "{name}: after going back inside a verified block: {err}");

        // The prompt and a left-padded shorter one in one batch, then a step.
        let (long, short) = (n as i64 - 1, 25i64);
        let (first, second) = left_padded_pair(&t, &r.ids, long, short);
        for (row, len) in [(0i64, long), (1, short)] {
            let err = max_rel_err(&first.get(row), &r.logits.get(len - 1));
            assert!(err < TOLERANCE, "{name}: row {row} prefill: {err}");
            let err = max_rel_err(&second.get(row), &r.logits.get(len));
            assert!(err < TOLERANCE, "{name}: row {row} after one step: {err}");
        }
    }
}

#[test]
fn published_multimodal_checkpoints_load_their_language_model_and_skip_the_rest() {
    for (name, mtp) in [("tiny-qwen3.5-vl", 1), ("tiny-qwen3.5-moe-vl", 1), ("tiny-qwen3-next", 0)] {
        let dir = fixtures().join(name);
        let i = TargetModel::inspect(&dir, Kind::Float, LoadScope::Full).unwrap();
        assert_eq!(i.config.mtp_layers, mtp, "{name}");
        let found = |prefix: &str| i.skipped.iter().find(|s| s.part.prefix == prefix).map_or(0, |s| s.tensors);
        assert!(found("mtp.") > 0, "{name}: the MTP tensors are found and skipped");
        if name.ends_with("-vl") {
            assert!(found("model.visual.") > 10, "{name}: the vision tower is found and skipped");
            assert_eq!(i.config.tensor_names.language_model.as_deref(), Some("model.language_model."));
        }
        // What is held is exactly the text model's parameters.
        assert_eq!(i.bytes, 4 * i.config.parameter_count() as u64, "{name}");
    }
    // The multimodal and text-only layouts of one model read to one shape.
    let text = TargetConfig::from_dir(&fixtures().join("tiny-qwen3.5-moe")).unwrap();
    let vl = TargetConfig::from_dir(&fixtures().join("tiny-qwen3.5-moe-vl")).unwrap();
    assert_eq!(
        (text.hidden_size, text.layer_types.clone(), text.moe.clone()),
        (vl.hidden_size, vl.layer_types.clone(), vl.moe.clone())
    );
}

#[test]
fn both_config_layouts_read_to_the_same_model() {
    let tf5 = TargetConfig::from_dir(&fixtures().join("tiny-llama3")).unwrap();
    let tf4 = TargetConfig::from_dir(&fixtures().join("tiny-llama3-tf4")).unwrap();
    assert_eq!(tf5, tf4);
    // The report that started this: a Qwen3 saved by transformers 5 keeps
    // its base only in rope_parameters.
    let q = TargetConfig::from_dir(&fixtures().join("tiny-qwen3-tf5")).unwrap();
    assert_eq!(q.rope.theta, 1_000_000.0);
    let moe = TargetConfig::from_dir(&fixtures().join("tiny-qwen3-moe")).unwrap().moe.unwrap();
    assert_eq!((moe.num_experts, moe.top_k, moe.dense_layers.clone()), (8, 2, vec![1]), "num_local_experts (5.x)");
    let moe4 = TargetConfig::from_dir(&fixtures().join("tiny-qwen3-moe-step2")).unwrap().moe.unwrap();
    assert_eq!((moe4.num_experts, moe4.sparse_step), (8, 2), "num_experts (4.x)");
}

#[test]
fn parameter_counts_and_sizes_match_the_checkpoints() {
    for name in [
        "tiny-llama3",
        "tiny-qwen3-moe",
        "tiny-qwen3-moe-step2",
        "tiny-qwen2",
        "tiny-qwen3.5",
        "tiny-qwen3.5-moe",
        "tiny-gpt-oss",
        "tiny-moonlight",
    ] {
        let dir = fixtures().join(name);
        let dflash_models::Inspection { config: c, bytes, .. } =
            TargetModel::inspect(&dir, Kind::Float, LoadScope::Full).unwrap();
        let stored: i64 = dflash_models::weights::Weights::load(&dir, Device::Cpu, Kind::Float, |_| true)
            .unwrap()
            .into_tensors()
            .iter()
            .map(|(_, t)| t.numel() as i64)
            .sum();
        assert_eq!(c.parameter_count(), stored, "{name}");
        assert_eq!(bytes, 4 * stored as u64, "{name}: f32 bytes held");
    }
}

/// A copy of a fixture to break.
fn copy_fixture(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixtures().join(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    dir
}

fn load_err(dir: &Path) -> String {
    TargetModel::load(dir, Device::Cpu, Kind::Float, LoadScope::Full).err().unwrap().to_string()
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&p, v.to_string()).unwrap();
}

/// Rewrites one tensor of a single-file checkpoint (same bytes, new header).
fn rewrite_tensor(dir: &Path, file: &str, name: &str, replace: impl FnOnce(Tensor) -> Option<Tensor>) {
    let path = dir.join(file);
    let mut tensors =
        dflash_models::weights::Weights::load(dir, Device::Cpu, Kind::Float, |_| true).unwrap().into_tensors();
    let i = tensors.iter().position(|(n, _)| n == name).unwrap();
    let (n, t) = tensors.remove(i);
    if let Some(t) = replace(t) {
        tensors.push((n, t));
    }
    dflash_models::weights::write_safetensors(&path, &tensors).unwrap();
}

#[test]
fn bad_models_are_refused_naming_the_file_and_the_tensor_or_field() {
    // A missing shard: the index still names it.
    let dir = copy_fixture("tiny-qwen3");
    std::fs::remove_file(dir.path().join("model-00002-of-00002.safetensors")).unwrap();
    let err = TargetModel::load(dir.path(), Device::Cpu, Kind::Float, LoadScope::Full).err().unwrap();
    assert!(matches!(err, ModelError::Io { .. }), "{err}");
    assert!(err.to_string().contains("model-00002-of-00002.safetensors"), "{err}");

    // An unknown architecture.
    let dir = copy_fixture("tiny-qwen3");
    edit_config(dir.path(), |v| v["architectures"] = serde_json::json!(["GPT2LMHeadModel"]));
    let err = load_err(dir.path());
    assert!(err.contains("GPT2LMHeadModel") && err.contains("not supported"), "{err}");

    // Unsupported RoPE, quantization, or a field that is not read.
    for (edit, want) in [
        (serde_json::json!({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}), "\"dynamic\" is not supported"),
        (serde_json::json!({"quantization_config": {"quant_method": "awq", "bits": 4}}), "\"awq\" is not supported"),
        (
            serde_json::json!({"use_sliding_window": true, "sliding_window": 8, "max_window_layers": 0}),
            "sliding-window",
        ),
        (serde_json::json!({"final_logit_softcapping": 30.0}), "final_logit_softcapping"),
    ] {
        let dir = copy_fixture("tiny-llama3");
        let arch = if want == "sliding-window" { "Qwen2ForCausalLM" } else { "LlamaForCausalLM" };
        edit_config(dir.path(), |v| {
            for (k, x) in edit.as_object().unwrap() {
                v[k] = x.clone();
            }
            v["architectures"] = serde_json::json!([arch]);
            if arch == "Qwen2ForCausalLM" {
                v.as_object_mut().unwrap().remove("mlp_bias");
            }
        });
        let err = load_err(dir.path());
        assert!(err.contains(want) && err.contains("config.json"), "{want}: {err}");
    }

    // A tensor of the wrong shape, a missing one, one of an unsupported dtype.
    let dir = copy_fixture("tiny-llama3");
    rewrite_tensor(dir.path(), "model.safetensors", "model.layers.1.mlp.up_proj.weight", |t| Some(t.narrow(0, 0, 8)));
    let err = load_err(dir.path());
    assert!(err.contains("model.layers.1.mlp.up_proj.weight") && err.contains("shape"), "{err}");
    let dir = copy_fixture("tiny-llama3");
    rewrite_tensor(dir.path(), "model.safetensors", "model.layers.2.self_attn.o_proj.bias", |_| None);
    let err = load_err(dir.path());
    assert!(err.contains("missing tensor model.layers.2.self_attn.o_proj.bias"), "{err}");
    let dir = copy_fixture("tiny-llama3");
    let bytes = std::fs::read(dir.path().join("model.safetensors")).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8(bytes[8..8 + header_len].to_vec()).unwrap();
    // Retag the first F32 tensor as U32 (same size): an unsupported dtype.
    let retagged = header.replacen("\"F32\"", "\"U32\"", 1);
    std::fs::write(
        dir.path().join("model.safetensors"),
        [&bytes[..8], retagged.as_bytes(), &bytes[8 + header_len..]].concat(),
    )
    .unwrap();
    let err = load_err(dir.path());
    assert!(err.contains("unsupported dtype U32") && err.contains("model.safetensors"), "{err}");

    // A truncated shard.
    let dir = copy_fixture("tiny-qwen3-moe");
    let shard = dir.path().join("model-00002-of-00002.safetensors");
    let len = std::fs::metadata(&shard).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&shard).unwrap().set_len(len - 100).unwrap();
    let err = load_err(dir.path());
    assert!(err.contains("model-00002-of-00002.safetensors") && err.contains("truncated"), "{err}");

    // FP8: a scale missing, a scale of the wrong grid, float8 weights in a
    // checkpoint that says it is not quantized.
    let dir = copy_fixture("tiny-qwen3-fp8");
    let fp8_names = |dir: &Path| {
        let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        safetensors::SafeTensors::deserialize(&bytes).unwrap().names().iter().map(|s| s.to_string()).collect::<Vec<_>>()
    };
    assert!(fp8_names(dir.path()).contains(&"model.layers.0.self_attn.q_proj.weight_scale_inv".to_string()));
    edit_config(dir.path(), |v| v["quantization_config"]["weight_block_size"] = serde_json::json!([32, 32]));
    let err = load_err(dir.path());
    assert!(err.contains("weight_scale_inv") && err.contains("expected"), "{err}");
    let dir = copy_fixture("tiny-qwen3-fp8");
    edit_config(dir.path(), |v| drop(v.as_object_mut().unwrap().remove("quantization_config")));
    let err = load_err(dir.path());
    assert!(err.contains("is float8") && err.contains("quantization_config"), "{err}");

    // MXFP4: blocks without their scales, u8 blocks in a checkpoint that
    // says it is not quantized.
    let dir = copy_fixture("tiny-gpt-oss-mxfp4");
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, Tensor)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != "model.layers.1.mlp.experts.down_proj_scales")
        .map(|(n, v)| {
            let kind = match v.dtype() {
                safetensors::Dtype::U8 => Kind::Uint8,
                _ => Kind::BFloat16,
            };
            let shape: Vec<i64> = v.shape().iter().map(|&d| d as i64).collect();
            (n, Tensor::f_from_data_size(v.data(), &shape, kind).unwrap())
        })
        .collect();
    drop(st);
    dflash_models::weights::write_safetensors(&path, &kept).unwrap();
    let err = load_err(dir.path());
    assert!(err.contains("model.layers.1.mlp.experts.down_proj_scales"), "{err}");
    let dir = copy_fixture("tiny-gpt-oss-mxfp4");
    edit_config(dir.path(), |v| drop(v.as_object_mut().unwrap().remove("quantization_config")));
    let err = load_err(dir.path());
    assert!(err.contains("is u8") && err.contains("quantization_config"), "{err}");
}

#[test]
fn bf16_weights_load_and_agree_with_f32() {
    for name in [
        "tiny-qwen3",
        "tiny-qwen3-moe",
        "tiny-qwen3-fp8",
        "tiny-qwen3-next",
        "tiny-qwen3.5-moe",
        "tiny-gpt-oss-mxfp4",
        "tiny-deepseek-v3-fp8",
        "tiny-glm4-moe",
    ] {
        let dir = fixtures().join(name);
        let t32 = TargetModel::load(&dir, Device::Cpu, Kind::Float, LoadScope::Full).unwrap();
        let t16 =
            TargetModel::load(&dir, Device::Cpu, Kind::BFloat16, LoadScope::CaptureUpTo { last_layer: 1 }).unwrap();
        let ids = Tensor::from_slice(&[5i64, 6, 7, 8, 9, 10]);
        let a = t32.capture_packed(&ids, &[6], &[1]);
        let b = t16.capture_packed(&ids, &[6], &[1]);
        assert_eq!(b[0].kind(), Kind::BFloat16);
        let err = max_rel_err(&b[0], &a[0]);
        assert!(err < 5e-2, "{name}: bf16 vs f32: {err}");
    }
}

#[test]
fn drafter_can_start_from_the_targets_top_layers_and_final_norm() {
    use dflash_models::{Drafter, DrafterConfig};
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

/// Transformers 5 keeps a MoE block's experts fused in memory
/// (`mlp.experts.gate_up_proj` `[E, 2I, H]`, `mlp.experts.down_proj`
/// `[E, H, I]`); a checkpoint written in that layout loads to the same
/// model as the published per-expert keys, matching transformers' outputs.
#[test]
fn fused_expert_weights_load_to_the_same_model_as_per_expert_keys() {
    let src = fixtures().join("tiny-qwen3-moe");
    let c = TargetConfig::from_dir(&src).unwrap();
    let experts = c.moe.as_ref().unwrap().num_experts;
    let mut tensors: std::collections::BTreeMap<String, Tensor> =
        dflash_models::weights::Weights::load(&src, Device::Cpu, Kind::Float, |_| true)
            .unwrap()
            .into_tensors()
            .into_iter()
            .collect();
    let mut fused_layers = 0;
    for l in 0..c.num_layers {
        let p = format!("model.layers.{l}.mlp.experts");
        if !tensors.contains_key(&format!("{p}.0.gate_proj.weight")) {
            continue; // a dense layer (mlp_only_layers)
        }
        let (mut gate_up, mut down) = (Vec::new(), Vec::new());
        for e in 0..experts {
            let mut take = |w: &str| tensors.remove(&format!("{p}.{e}.{w}.weight")).unwrap();
            let (g, u, d) = (take("gate_proj"), take("up_proj"), take("down_proj"));
            gate_up.push(Tensor::cat(&[g, u], 0));
            down.push(d);
        }
        tensors.insert(format!("{p}.gate_up_proj"), Tensor::stack(&gate_up, 0));
        tensors.insert(format!("{p}.down_proj"), Tensor::stack(&down, 0));
        fused_layers += 1;
    }
    assert!(fused_layers >= 2, "the fixture has sparse layers to fuse");
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
    let tensors: Vec<(String, Tensor)> = tensors.into_iter().collect();
    dflash_models::weights::write_safetensors(&dir.path().join("model.safetensors"), &tensors).unwrap();

    let fused = TargetModel::load(dir.path(), Device::Cpu, Kind::Float, LoadScope::Full).unwrap();
    let r = reference(&src);
    let all: Vec<i64> = (0..fused.config.num_layers).collect();
    let ids = Tensor::from_slice(&r.ids);
    let captured = fused.capture_packed(&ids, &[r.ids.len() as i64], &all);
    for (l, want) in r.hidden.iter().enumerate() {
        let err = max_rel_err(&captured[l], want);
        assert!(err < TOLERANCE, "fused layout, layer {l}: {err}");
    }
    // A fused tensor of the wrong shape is named.
    let bad: Vec<(String, Tensor)> = tensors
        .iter()
        .map(|(n, t)| {
            let t = if n == "model.layers.0.mlp.experts.down_proj" {
                t.narrow(0, 0, experts - 1)
            } else {
                t.shallow_clone()
            };
            (n.clone(), t)
        })
        .collect();
    dflash_models::weights::write_safetensors(&dir.path().join("model.safetensors"), &bad).unwrap();
    let err = load_err(dir.path());
    assert!(err.contains("model.layers.0.mlp.experts.down_proj"), "{err}");
}

/// The packed capture path on a GPU (f32, and bf16 with half-precision
/// products in the delta rule) against transformers, on packed batches
/// whose sequences span several chunks.
#[test]
#[ignore = "needs a CUDA GPU"]
fn hybrid_capture_on_cuda_matches_transformers() {
    dflash_models::cuda::ensure_cuda(&[0]).unwrap();
    let gpu = Device::Cuda(0);
    for name in HYBRIDS {
        let dir = fixtures().join(name);
        let r = reference(&dir);
        let n = r.ids.len() as i64;
        let all: Vec<i64> = (0..r.hidden.len() as i64).collect();
        let packed = Tensor::from_slice(&[&r.ids[..70], &r.ids[..]].concat()).to_device(gpu);
        for (kind, tolerance) in [(Kind::Float, 1e-5), (Kind::BFloat16, 5e-2)] {
            let t = TargetModel::load(&dir, gpu, kind, LoadScope::Full).unwrap();
            let captured = t.capture_packed(&packed, &[70, n], &all);
            for (l, want) in r.hidden.iter().enumerate() {
                let got = captured[l].to_device(Device::Cpu);
                let err = max_rel_err(&got.narrow(0, 70, n), want);
                assert!(err < tolerance, "{name} {kind:?} layer {l}: {err}");
                let err = max_rel_err(&got.narrow(0, 0, 70), &want.narrow(0, 0, 70));
                assert!(err < tolerance, "{name} {kind:?} layer {l} (prefix): {err}");
            }
        }
    }
}

/// The delta rule's fused CUDA kernels against the recurrence, token by
/// token in f64 on the CPU: Qwen3.5's head shape (dk = dv = 128, on tensor
/// cores) and others (dk 16 to 128, dv 16 to 256, on CUDA cores), each key
/// head serving three value heads; packed sequences inside
/// one chunk, at a chunk's edge and across several, from zero and from
/// given states; f32 inputs and bf16 ones (whose recurrence is run on the
/// same rounded inputs). f32 and the CUDA-core kernels keep f32 accuracy;
/// bf16 on tensor cores multiplies in tf32 (10 mantissa bits, finer than
/// the bf16 the layer rounds its output to).
#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_delta_rule_on_cuda_matches_the_recurrence() {
    use dflash_models::delta_rule::{self, RuleInputs};
    dflash_models::cuda::ensure_cuda(&[0]).unwrap();
    let gpu = Device::Cuda(0);
    tch::manual_seed(21);
    let lens = [5i64, 64, 130, 1, 200, 63];
    let total: i64 = lens.iter().sum();
    for (dk, dv, bf16_tolerance) in
        [(128i64, 128i64, 3e-3), (64, 64, 2e-5), (128, 256, 2e-5), (32, 64, 2e-5), (16, 16, 2e-5)]
    {
        let (hk, h) = (2i64, 6i64);
        let f = (Kind::Float, Device::Cpu);
        let q = delta_rule::l2_normalize(&Tensor::randn([total, hk, dk], f)) * (dk as f64).powf(-0.5);
        let k = delta_rule::l2_normalize(&Tensor::randn([total, hk, dk], f));
        let v = Tensor::randn([total, h, dv], f);
        let g = -(Tensor::rand([total, h], f) * 4.0 + 0.01) * (Tensor::randn([total, h], f) + 1.0).softplus();
        let beta = Tensor::randn([total, h], f).sigmoid();
        let initial = Tensor::randn([lens.len() as i64, h, dk, dv], f) * 0.1;
        for (kind, tolerance) in [(Kind::Float, 2e-5), (Kind::BFloat16, bf16_tolerance)] {
            assert!(
                dflash_models::delta_rule_cuda::available(gpu, dk, dv, kind),
                "fused kernels for {kind:?}, dk {dk} dv {dv}"
            );
            // The inputs as the kernels see them (bf16 rounding included).
            let (q, k, v) = (q.to_kind(kind), k.to_kind(kind), v.to_kind(kind));
            let on = |t: &Tensor| t.to_device(gpu);
            for init in [None, Some(&initial)] {
                let got = dflash_models::delta_rule_cuda::chunked(
                    &RuleInputs { q: &on(&q), k: &on(&k), v: &on(&v), g: &on(&g), beta: &on(&beta) },
                    &delta_rule::ChunkPlan::new(&lens, gpu),
                    init.map(on).as_ref(),
                    &mut |_| {},
                )
                .expect("the fused kernels run");
                // The recurrence in f64, sequence by sequence.
                let dd = |t: &Tensor| t.to_kind(Kind::Double);
                let (mut outs, mut finals, mut start) = (Vec::new(), Vec::new(), 0);
                for (s, &l) in lens.iter().enumerate() {
                    let mut state = match init {
                        Some(i) => dd(&i.narrow(0, s as i64, 1)),
                        None => Tensor::zeros([1, h, dk, dv], (Kind::Double, Device::Cpu)),
                    };
                    for t in start..start + l {
                        let one = |x: &Tensor| dd(&x.narrow(0, t, 1));
                        let x = RuleInputs { q: &one(&q), k: &one(&k), v: &one(&v), g: &one(&g), beta: &one(&beta) };
                        let (o, s1) = delta_rule::step(&x, &state);
                        state = s1;
                        outs.push(o);
                    }
                    finals.push(state);
                    start += l;
                }
                let want = Tensor::cat(&outs, 0);
                let want_final = Tensor::cat(&finals, 0);
                let label = format!("dk {dk} dv {dv} {kind:?} (initial {})", init.is_some());
                let err = max_rel_err(&got.out.to_device(Device::Cpu), &want);
                println!("{label}: outputs within {err:.2e}");
                assert!(err < tolerance, "{label} outputs: {err}");
                let err = max_rel_err(&got.final_state.to_device(Device::Cpu), &want_final);
                println!("{label}: final states within {err:.2e}");
                assert!(err < tolerance, "{label} final states: {err}");
            }
        }
    }
}

/// The fused gated norm against the libtorch ops it replaces (RMSNorm per
/// value head in f32, then weight and silu(z) in the model's kind), z read
/// in place from a wider projection: f32 to rounding, bf16 to one rounding
/// of the output (the sums of squares are added in another order).
#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_gated_norm_on_cuda_matches_the_ops() {
    dflash_models::cuda::ensure_cuda(&[0]).unwrap();
    let gpu = Device::Cuda(0);
    tch::manual_seed(5);
    let (n, nv, dv, z_col, width) = (333i64, 6i64, 128i64, 40i64, 900i64);
    for (kind, tolerance) in [(Kind::Float, 1e-6), (Kind::BFloat16, 8e-3)] {
        let out = Tensor::randn([n, nv, dv], (Kind::Float, gpu)) * 3.0;
        let proj = Tensor::randn([n, width], (kind, gpu)) * 2.0;
        let w = (Tensor::randn([dv], (Kind::Float, gpu)) + 1.0).to_kind(kind);
        let got = dflash_models::delta_rule_cuda::gated_norm(&out, &proj, z_col, &w, 1e-6, 128)
            .expect("the fused kernel runs");
        let z = proj.narrow(1, z_col, nv * dv).reshape([n, nv, dv]);
        let normed = out.rms_norm([dv], None::<Tensor>, 1e-6).to_kind(kind);
        let want = (normed * &w * z.silu()).reshape([n, nv * dv]);
        assert_eq!(got.size(), want.size());
        let err = max_rel_err(
            &got.to_kind(Kind::Float).to_device(Device::Cpu),
            &want.to_kind(Kind::Float).to_device(Device::Cpu),
        );
        assert!(err < tolerance, "{kind:?}: {err}");
    }
}

/// The fused row kernels of the capture path against the libtorch ops they
/// replace, on shapes of the published models and odd row counts: the
/// f32-scale RMSNorm (hidden rows and per-head rows), the MoE un-permute
/// (each token's weighted sum over its expert rows), the Qwen router's
/// softmax and top-k, the grouping of the pairs by expert (exactly a stable
/// sort's) and the experts' SwiGLU; f32 to rounding, bf16 to one rounding of
/// the output (sums are added in another order).
#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_row_kernels_on_cuda_match_the_ops() {
    use dflash_models::fused_cuda;
    dflash_models::cuda::ensure_cuda(&[0]).unwrap();
    let gpu = Device::Cuda(0);
    tch::manual_seed(9);
    let cpu = |t: &Tensor| t.to_kind(Kind::Float).to_device(Device::Cpu);
    for (kind, tolerance) in [(Kind::Float, 1e-6), (Kind::BFloat16, 8e-3)] {
        for (rows, dim) in [(333i64, 2048i64), (1000, 256), (5, 64)] {
            let x = Tensor::randn([rows, dim], (kind, gpu)) * 3.0;
            let w = Tensor::randn([dim], (Kind::Float, gpu)) * 0.1 + 1.0;
            let got = fused_cuda::rms_norm_f32_scale(&x, &w, 1e-6).expect("the RMSNorm kernel runs");
            let want = x.to_kind(Kind::Float).rms_norm([dim], Some(&w), 1e-6).to_kind(kind);
            let err = max_rel_err(&cpu(&got), &cpu(&want));
            assert!(err < tolerance, "RMSNorm {kind:?} [{rows}, {dim}]: {err}");
        }
        let (t, k, h) = (517i64, 8i64, 2048i64);
        let out = Tensor::randn([t * k, h], (kind, gpu));
        let order = Tensor::randperm(t * k, (Kind::Int64, gpu));
        let inverse = order.empty_like().scatter(0, &order, &Tensor::arange(t * k, (Kind::Int64, gpu)));
        let weights = Tensor::rand([t, k], (Kind::Float, gpu)).softmax(-1, Kind::Float).to_kind(kind);
        let got = fused_cuda::moe_unpermute(&out, &inverse, &weights).expect("the un-permute kernel runs");
        let want = weights.unsqueeze(1).bmm(&out.index_select(0, &inverse).view([t, k, h])).squeeze_dim(1);
        let err = max_rel_err(&cpu(&got), &cpu(&want));
        assert!(err < tolerance, "MoE un-permute {kind:?}: {err}");
        // The Qwen router (256 experts, top 8; 60 experts, top 4 unnormalised)
        // and the grouping of the pairs by expert, which must be exactly a
        // stable sort's.
        for (e, top, renorm) in [(256i64, 8i64, true), (60, 4, false)] {
            // Distinct logits, exact in bf16 (a permutation of steps of 1/16),
            // so that the top k is one set.
            let perm = Tensor::rand([t, e], (Kind::Float, gpu)).argsort(-1, false);
            let logits = (perm.to_kind(Kind::Float) * 0.0625 - 8.0).to_kind(kind);
            let (chosen, w) = fused_cuda::route_softmax_topk(&logits, top, renorm).expect("the routing kernel runs");
            let (mut want_w, want_chosen) = logits.softmax(-1, Kind::Float).topk(top, -1, true, true);
            if renorm {
                want_w = &want_w / want_w.sum_dim_intlist(-1, true, Kind::Float);
            }
            assert!(chosen.equal(&want_chosen), "routing {kind:?} E {e}: other experts chosen");
            let err = max_rel_err(&cpu(&w), &cpu(&want_w.to_kind(kind)));
            assert!(err < tolerance, "routing weights {kind:?} E {e}: {err}");
            let got = fused_cuda::expert_order(&chosen, e).expect("the grouping kernels run");
            let flat = chosen.reshape([-1]);
            let order = flat.argsort_stable(true, 0, false);
            assert!(got.order.equal(&order), "pairs grouped in another order");
            assert!(got.token.equal(&order.floor_divide_scalar(top)), "tokens of the grouped pairs");
            assert!(got.inverse.index_select(0, &order).equal(&Tensor::arange(t * top, (Kind::Int64, gpu))));
            let counts = Tensor::zeros([e], (Kind::Int64, gpu)).scatter_add(0, &flat, &flat.ones_like());
            assert!(got.offsets.equal(&counts.cumsum(0, Kind::Int)), "offsets per expert");
        }
        let (n, i) = (1003i64, 512i64);
        let gate_up = Tensor::randn([n, 2 * i], (kind, gpu)) * 2.0;
        let got = fused_cuda::swiglu(&gate_up).expect("the SwiGLU kernel runs");
        let want = gate_up.narrow(1, 0, i).silu() * gate_up.narrow(1, i, i);
        let err = max_rel_err(&cpu(&got), &cpu(&want));
        assert!(err < tolerance, "SwiGLU {kind:?}: {err}");
    }
}
