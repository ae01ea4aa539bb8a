//! The one-machine run: `dflash up` starts the three roles as processes,
//! trains to the end and leaves a served-layout checkpoint and a ledger in
//! which every batch was trained and committed exactly once.

#![allow(clippy::unwrap_used)] // tests panic on failure by design

use std::time::Duration;

use dflash_coordinator::ledger::Ledger;
use dflash_tests::{Workspace, safetensors_names};

#[test]
fn dflash_up_trains_to_the_end_and_commits_every_batch_once() {
    trains_to_the_end(&Workspace::synthetic(300, 4));
}

#[test]
fn a_mixture_of_experts_target_trains_to_the_end_too() {
    let ws = Workspace::synthetic_shape(300, "tiny-moe");
    let log = trains_to_the_end(&ws);
    assert!(log.contains("layers of the Qwen3MoeForCausalLM target"), "{log}");
}

/// `dflash up` on the workspace's target: every role prints its config,
/// the run completes, the checkpoint is in the served layout and every
/// batch is trained and committed once. Returns the log.
fn trains_to_the_end(ws: &Workspace) -> String {
    let config = ws.config("up-split", "");
    let mut up = dflash_tests::up(ws, &config, &[], &[]);
    let status = up.expect_exit(Duration::from_secs(180));
    let log = up.log_text();
    assert!(status.success(), "dflash up failed:\n{log}");

    // Every role printed the grouped config block with the pipeline knobs.
    for role in ["coordinator", "target", "drafter"] {
        let block = format!(
            "[{role:<11}]     Prefetch depth: 2, HS queue: 8, training in plan order (reorder window 8)\n[{role:<11}]     Target postprocess depth: 1, split FC layers: true"
        );
        assert!(log.contains(&block), "{role} did not print the pipeline block:\n{log}");
    }
    assert!(log.contains("run completed"), "{log}");
    // By default checkpoints are written on a writer thread from a host snapshot.
    assert!(log.contains("written while training goes on"), "{log}");
    assert!(log.contains("training paused"), "{log}");
    // The training figures are drawn into the run folder, and the path said.
    let plot = ws.path("up/training.svg");
    assert!(log.contains(&format!("training plot: {}", plot.display())), "{log}");
    let svg = std::fs::read_to_string(&plot).expect("the training plot");
    assert!(svg.starts_with("<svg") && svg.contains("width=\"960\"") && svg.contains("height=\"720\""));
    let lines = svg.matches("stroke-width=\"2\" points=").count();
    assert_eq!(lines, 3, "loss, accuracy and acceptance over the steps");
    // A finished run closes its hidden-state streams; it does not break them.
    assert!(!log.contains("broke"), "a stream broke at the end of the run:\n{log}");

    // The final checkpoint is in the served layout.
    let latest = std::fs::read_to_string(ws.path("checkpoints/latest")).expect("latest pointer");
    let dir = ws.path("checkpoints").join(latest.trim());
    assert_eq!(latest.trim(), "step-00000012");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["architectures"][0], "DFlashDraftModel");
    assert_eq!(config["dflash_config"]["mask_token_id"], 3);
    assert_eq!(config["num_hidden_layers"], 1);
    assert_eq!(config["block_size"], 8);
    let names = safetensors_names(&dir.join("model.safetensors"));
    let want: Vec<String> = [
        "fc.weight",
        "hidden_norm.weight",
        "layers.0.input_layernorm.weight",
        "layers.0.mlp.down_proj.weight",
        "layers.0.mlp.gate_proj.weight",
        "layers.0.mlp.up_proj.weight",
        "layers.0.post_attention_layernorm.weight",
        "layers.0.self_attn.k_norm.weight",
        "layers.0.self_attn.k_proj.weight",
        "layers.0.self_attn.o_proj.weight",
        "layers.0.self_attn.q_norm.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.self_attn.v_proj.weight",
        "norm.weight",
    ]
    .map(String::from)
    .to_vec();
    assert_eq!(names, want);

    // Ledger: 12 batches, each trained once and committed once.
    let ledger = Ledger::open(&ws.path("up/ledger.sqlite")).unwrap();
    let audit = ledger.audit().unwrap();
    assert_eq!(audit.len(), 12);
    for a in &audit {
        assert_eq!((a.state.as_str(), a.trains, a.commits), ("committed", 1, 1), "{a:?}");
    }
    log
}

#[test]
fn packed_layout_with_noise_trains_too() {
    let ws = Workspace::synthetic(200, 3);
    let config = ws.config("up-packed", "");
    let mut up = dflash_tests::up(
        &ws,
        &config,
        &[
            "--no-split-fc-layers",
            "--max-steps",
            "6",
            "--set",
            "training.feature_noise_std=0.05",
            "--set",
            "checkpoint.async_write=false",
            "--target-postprocess-depth",
            "0",
        ],
        &[],
    );
    let status = up.expect_exit(Duration::from_secs(180));
    let log = up.log_text();
    assert!(status.success(), "dflash up failed:\n{log}");
    assert!(log.contains("Target postprocess depth: 0, split FC layers: false"), "{log}");
    // Checkpoints written in the train loop (not on a writer thread) commit too.
    assert!(log.contains("training waits for each write"), "{log}");
    assert!(log.contains("step-00000006 written in"), "{log}");
    assert!(log.contains("PACKED layout"), "{log}");
    assert!(log.contains("step 6/6"), "{log}");
}

/// Distillation end to end: the target runs to its LM head and ships its
/// top-k next tokens beside the features (from its feature cache in the
/// second epoch), the drafter trains on every batch, and the printout says so.
#[test]
fn distillation_trains_on_the_targets_top_k() {
    let ws = Workspace::synthetic(200, 3);
    let config = ws.config("up-kd", "");
    let mut up = dflash_tests::up(
        &ws,
        &config,
        &[
            "--set",
            "training.loss=\"kd\"",
            "--set",
            "training.kd_top_k=8",
            "--set",
            "pipeline.target_feature_cache_mib=64",
            "--set",
            "run.epochs=2",
        ],
        &[],
    );
    let status = up.expect_exit(Duration::from_secs(180));
    let log = up.log_text();
    assert!(status.success(), "dflash up failed:\n{log}");
    assert!(
        log.contains("Objective: distillation (cross-entropy to the target's top-8 next-token distribution)"),
        "{log}"
    );
    assert!(log.contains("and its top-8 next tokens for distillation"), "{log}");
    assert!(log.contains("run completed"), "{log}");
    assert!(!log.contains("skipped batch"), "no batch was skipped:\n{log}");
}

/// The run ends with the report over every `[eval]` prompt set: the
/// primary set after an offset, and a further set sampled across its
/// categories, each next to an untrained drafter, with the sentence that
/// explains speed against tau from what was measured. The target is one
/// instance split into two CPU parts (`devices.target = "cpu,cpu"`).
#[test]
fn dflash_up_ends_with_a_report_over_every_eval_set() {
    let ws = Workspace::synthetic(300, 4);
    let by_category: Vec<String> = ["a", "a", "b", "b", "c"]
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let text = format!("Question {i} of category {c}: what comes next?");
            serde_json::json!({"id": format!("q{i}"), "category": c, "messages": [{"role": "user", "content": text}]})
                .to_string()
        })
        .collect();
    std::fs::write(ws.path("cats.jsonl"), by_category.join("\n") + "\n").unwrap();
    let eval = format!(
        "[eval]\nname = \"held-out\"\nprompts_path = \"{data}\"\nprompts_offset = 290\nmax_prompts = 3\n\
         max_new_tokens = 12\n[[eval.sets]]\nname = \"sampled\"\nprompts_path = \"{cats}\"\nper_category = 1\n",
        data = ws.path("data.jsonl").display(),
        cats = ws.path("cats.jsonl").display(),
    );
    let config = ws.config("report", &eval);
    let mut up = dflash_tests::up(&ws, &config, &["--target-devices", "cpu,cpu"], &[]);
    let status = up.expect_exit(Duration::from_secs(240));
    let log = up.log_text();
    assert!(status.success(), "dflash up failed:\n{log}");
    // 4 layers, one drafter layer capturing layer 2: layers 0-2 in two parts.
    // The part holding layer 2 also keeps its captures (three batches of 1024
    // tokens x 64 f32, more than a layer and the embedding of this model):
    // of the two equal splits, that part takes fewer layers.
    assert!(log.contains("target cpu,cpu: layers 0-1 on cpu (needs") && log.contains("; layers 2-2 on cpu"), "{log}");

    let report = std::fs::read_to_string(ws.path("up/report.txt")).expect("the report");
    assert!(log.contains(&format!("report ({}):", ws.path("up/report.txt").display())), "{log}");
    let rows: Vec<&str> = report.lines().collect();
    assert!(rows[0].contains("untrained") && rows[0].contains("vs greedy"), "{report}");
    assert!(rows[1].starts_with("held-out ") && rows[1].split_whitespace().nth(1) == Some("3"), "{report}");
    assert!(rows[2].starts_with("sampled (3 categories)") && rows[2].contains(" 3 "), "{report}");
    assert!(report.contains("Why speed and tau differ here: one draft-and-verify step cost"), "{report}");
    // Each set's eval file: the prompts it picked and both drafters.
    for (i, want) in [(0, vec!["291", "292", "293"]), (1, vec!["q0", "q2", "q4"])] {
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(ws.path(&format!("up/eval-{i}.json"))).unwrap()).unwrap();
        let labels: Vec<&str> = v["reports"].as_array().unwrap().iter().map(|r| r["label"].as_str().unwrap()).collect();
        assert_eq!(labels, ["untrained", "trained"]);
        let ids: Vec<&str> =
            v["reports"][1]["per_prompt"].as_array().unwrap().iter().map(|p| p[0].as_str().unwrap()).collect();
        assert_eq!(ids, want, "set {i} picked other prompts");
    }
}
