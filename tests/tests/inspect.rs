//! `dflash-target inspect`, the model check users run before a long run:
//! it prints what a directory resolves to, and its JSON output (logits of
//! every position, residual streams after chosen layers) matches
//! transformers' forward of the same fixture; a broken model is refused
//! with the file and field named and a non-zero exit.

#![allow(clippy::unwrap_used)] // tests panic on failure by design

use std::path::PathBuf;
use std::process::Command;

use dflash_tests::bin;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(name)
}

/// A reference tensor (f32 or i64) of a fixture as nested rows.
fn reference(name: &str, tensor: &str) -> (Vec<usize>, Vec<f64>) {
    let bytes = std::fs::read(fixture(name).join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let v = st.tensor(tensor).unwrap();
    let values = match v.dtype() {
        safetensors::Dtype::I64 => {
            v.data().chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f64).collect()
        }
        _ => v.data().chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64).collect(),
    };
    (v.shape().to_vec(), values)
}

fn max_rel_err(got: &serde_json::Value, want: &[f64]) -> f64 {
    let got: Vec<f64> = got
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r.as_array().unwrap().iter())
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
    got.iter().zip(want).fold(0f64, |m, (g, w)| m.max((g - w).abs())) / scale
}

#[test]
fn inspect_prints_the_model_and_its_outputs_match_transformers() {
    for name in ["tiny-qwen3-moe-fp8", "tiny-llama3-tf4", "tiny-qwen3-yarn", "tiny-qwen3.5-moe-vl", "tiny-qwen3-next"] {
        let (_, ids) = reference(name, "ids");
        let ids: Vec<String> = ids.iter().map(|&i| (i as i64).to_string()).collect();
        let out = tempfile::tempdir().unwrap();
        let json = out.path().join("outputs.json");
        let run = Command::new(bin("dflash-target"))
            .args(["inspect", "--model"])
            .arg(fixture(name))
            .args(["--ids", &ids.join(","), "--layers", "0,1", "--json"])
            .arg(&json)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&run.stdout);
        assert!(run.status.success(), "{name}: {stdout}{}", String::from_utf8_lossy(&run.stderr));
        for line in ["architecture:", "RoPE:", "parameters:", "memory:", "captured layers:"] {
            assert!(stdout.contains(line), "{name}: no {line}\n{stdout}");
        }
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        assert_eq!(v["ids"].as_array().unwrap().len(), ids.len());
        let err = max_rel_err(&v["logits"], &reference(name, "logits").1);
        assert!(err < 1e-5, "{name}: logits {err}");
        for layer in ["0", "1"] {
            let err = max_rel_err(&v["layers"][layer], &reference(name, &format!("hidden.{layer}")).1);
            assert!(err < 1e-5, "{name}: layer {layer} {err}");
        }
    }
    let moe = Command::new(bin("dflash-target"))
        .args(["inspect", "--model"])
        .arg(fixture("tiny-qwen3-moe-fp8"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&moe.stdout);
    assert!(text.contains("Qwen3MoeForCausalLM") && text.contains("8 per sparse layer, top 2"), "{text}");
    assert!(text.contains("fp8 e4m3, 16x16 blocks") && text.contains("active per token"), "{text}");

    // A published multimodal hybrid: the language model, each layer's kind,
    // and what of the checkpoint is not read.
    let vl = Command::new(bin("dflash-target"))
        .args(["inspect", "--model"])
        .arg(fixture("tiny-qwen3.5-moe-vl"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&vl.stdout);
    for want in [
        "Qwen3_5MoeForCausalLM (Qwen35Moe), multimodal checkpoint: language model only",
        "0-2 linear attention, 3 full attention",
        "Gated DeltaNet, 2 key heads of 8, 4 value heads of 8, convolution 4",
        "output gate",
        "partial (factor 0.25)",
        "a gated shared expert of width 24",
        "vision tower (model.visual.*): 21 tensors",
        "multi-token prediction (1 layer) (mtp.*): 3 tensors",
        "captured layers:",
    ] {
        assert!(text.contains(want), "no {want:?} in\n{text}");
    }
}

/// `inspect --devices`: the plan of an instance split over two CPU parts
/// (each part's layers and memory against the host's), and `--ids` run
/// through the split model still matching transformers.
#[test]
fn inspect_plans_a_split_instance_and_runs_it() {
    let name = "tiny-qwen3.5-moe-vl";
    let (_, ids) = reference(name, "ids");
    let ids: Vec<String> = ids.iter().map(|&i| (i as i64).to_string()).collect();
    let out = tempfile::tempdir().unwrap();
    let json = out.path().join("outputs.json");
    let run = Command::new(bin("dflash-target"))
        .args(["inspect", "--model"])
        .arg(fixture(name))
        .args(["--devices", "cpu,cpu", "--tokens", "4096", "--ids", &ids.join(","), "--layers", "1", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{stdout}{}", String::from_utf8_lossy(&run.stderr));
    assert!(stdout.contains("layout cpu,cpu:") && stdout.contains("4096 tokens a batch"), "{stdout}");
    let parts: Vec<&str> = stdout.lines().filter(|l| l.contains(" on cpu: ") && l.contains(" free")).collect();
    assert_eq!(parts.len(), 2, "one line per part:\n{stdout}");
    assert!(parts[0].trim_start().starts_with("layers 0-"), "{stdout}");
    assert!(stdout.contains("ran 36 tokens on Cpu + Cpu") || stdout.contains("on Cpu + Cpu"), "{stdout}");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let err = max_rel_err(&v["logits"], &reference(name, "logits").1);
    assert!(err < 1e-5, "logits through two parts: {err}");
    let err = max_rel_err(&v["layers"]["1"], &reference(name, "hidden.1").1);
    assert!(err < 1e-5, "layer 1 through two parts: {err}");

    // More parts than layers: refused, saying why.
    let many = Command::new(bin("dflash-target"))
        .args(["inspect", "--model"])
        .arg(fixture(name))
        .args(["--devices", &["cpu"; 9].join(",")])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&many.stderr);
    assert!(!many.status.success() && err.contains("9 devices for") && err.contains("devices cpu,cpu"), "{err}");
}

#[test]
fn inspect_refuses_a_bad_model_naming_the_file_and_field() {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture("tiny-llama3")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    let config = dir.path().join("config.json");
    let text = std::fs::read_to_string(&config).unwrap().replace("\"llama3\"", "\"longrope\"");
    std::fs::write(&config, text).unwrap();
    let run = Command::new(bin("dflash-target")).args(["inspect", "--model"]).arg(dir.path()).output().unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("config.json") && stderr.contains("rope_parameters") && stderr.contains("longrope"),
        "{stderr}"
    );
}
