//! Models and data as users keep them: a Hugging Face hub cache in place of
//! a model directory, and Parquet files written as Hugging Face datasets
//! writes them (pyarrow, from the reference venv) in place of JSONL. Each
//! loads the same model or samples as its twin; what is wrong with one is
//! named (the file and the column, or the cache path).

#![allow(clippy::unwrap_used)] // tests panic on failure by design

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use dflash_data::{ChatTokenizer, Dataset, LoadOptions};
use dflash_tests::{Workspace, bin, reference_python, repo_root};

/// The Parquet twins of the workspace's JSONL dataset, in `ws/parquet`.
fn parquet_twins(ws: &Workspace) -> PathBuf {
    let out = ws.path("parquet");
    std::fs::create_dir_all(&out).unwrap();
    let script = repo_root().join("scripts/reference/parquet_fixtures.py");
    let r = Command::new(reference_python()).arg(script).arg(ws.path("data.jsonl")).arg(&out).output().unwrap();
    assert!(r.status.success(), "parquet_fixtures.py failed:\n{}", String::from_utf8_lossy(&r.stderr));
    out
}

/// A hub cache holding the workspace's model as `acme/tiny` at one commit.
fn hub_cache(ws: &Workspace) -> (PathBuf, PathBuf) {
    let hub = ws.path("hub");
    let commit = "6f1b0f3c2a9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c";
    let repo = hub.join("models--acme--tiny");
    let snapshot = repo.join("snapshots").join(commit);
    std::fs::create_dir_all(&snapshot).unwrap();
    for e in std::fs::read_dir(ws.path("model")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), snapshot.join(e.file_name())).unwrap();
    }
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), commit).unwrap();
    (hub, snapshot)
}

fn load(path: &Path, tok: &ChatTokenizer) -> Result<Dataset, String> {
    Dataset::load(path, tok, &LoadOptions::strict(256)).map_err(|e| e.to_string())
}

fn load_err(path: &Path, tok: &ChatTokenizer) -> String {
    match load(path, tok) {
        Ok(d) => panic!("{} loaded ({} samples)", path.display(), d.samples.len()),
        Err(e) => e,
    }
}

#[test]
fn parquet_datasets_load_the_same_samples_as_their_jsonl_twin_and_bad_ones_are_named() {
    let ws = Workspace::synthetic(120, 2);
    let dir = parquet_twins(&ws);
    let tok = ChatTokenizer::from_dir(&ws.path("model")).unwrap();
    let Ok(jsonl) = load(&ws.path("data.jsonl"), &tok) else { panic!("the JSONL twin loads") };
    assert!(jsonl.samples.len() >= 100);
    for name in ["messages.parquet", "conversations.parquet"] {
        let pq = load(&dir.join(name), &tok).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(pq.samples, jsonl.samples, "{name}: ids, tokens and loss masks");
        assert_eq!(pq.report.tokens, jsonl.report.tokens);
    }
    let err = load_err(&dir.join("wrong_column.parquet"), &tok);
    assert!(err.contains("wrong_column.parquet") && err.contains("column messages") && err.contains("turns"), "{err}");
    let err = load_err(&dir.join("wrong_types.parquet"), &tok);
    assert!(
        err.contains("wrong_types.parquet")
            && err.contains("column messages.list.element.content")
            && err.contains("not a string"),
        "{err}"
    );
    let not_parquet = ws.path("fake.parquet");
    std::fs::write(&not_parquet, "{\"messages\": []}\n").unwrap();
    let err = load_err(&not_parquet, &tok);
    assert!(err.contains("fake.parquet") && err.contains("not a readable Parquet file"), "{err}");
}

#[test]
fn a_hub_cache_repo_id_loads_the_same_model_as_its_directory() {
    let ws = Workspace::synthetic(20, 2);
    let (hub, _) = hub_cache(&ws);
    let inspect = |model: &str, json: &Path| {
        Command::new(bin("dflash-target"))
            .args(["inspect", "--model", model, "--ids", "1,2,3,4", "--layers", "0,1", "--json"])
            .arg(json)
            .env("HF_HUB_CACHE", &hub)
            .output()
            .unwrap()
    };
    let (a, b) = (ws.path("dir.json"), ws.path("hub.json"));
    let by_dir = inspect(ws.path("model").to_str().unwrap(), &a);
    assert!(by_dir.status.success(), "{}", String::from_utf8_lossy(&by_dir.stderr));
    let by_id = inspect("acme/tiny", &b);
    assert!(by_id.status.success(), "{}", String::from_utf8_lossy(&by_id.stderr));
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap(), "the same logits and layers");
    // A cache without the repo, and a repo without a snapshot, are named.
    let missing = inspect("acme/other", &b);
    let text = String::from_utf8_lossy(&missing.stderr);
    assert!(
        !missing.status.success() && text.contains("models--acme--other") && text.contains(hub.to_str().unwrap()),
        "{text}"
    );
    std::fs::create_dir_all(hub.join("models--acme--bare/snapshots")).unwrap();
    let bare = inspect("acme/bare", &b);
    let text = String::from_utf8_lossy(&bare.stderr);
    assert!(!bare.status.success() && text.contains("models--acme--bare") && text.contains("no snapshot"), "{text}");
}

#[test]
fn a_run_trains_from_a_hub_cache_repo_id_and_a_parquet_dataset() {
    let ws = Workspace::synthetic(200, 2);
    let dir = parquet_twins(&ws);
    let (hub, _) = hub_cache(&ws);
    let data = dir.join("messages.parquet");
    let extra = format!("[model]\ntarget_path = \"acme/tiny\"\n[data]\ntrain_path = \"{}\"\n", data.display());
    let config = ws.config("user-inputs", &extra);
    let hub_env = hub.display().to_string();
    let mut up = dflash_tests::up(&ws, &config, &[], &[("HF_HUB_CACHE", hub_env.as_str())]);
    let status = up.expect_exit(Duration::from_secs(240));
    let log = up.log_text();
    assert!(status.success(), "{log}");
    assert!(log.contains("acme/tiny") && log.contains("messages.parquet"), "{log}");
    assert!(log.contains("completed"), "{log}");
}
