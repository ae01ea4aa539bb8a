//! The public client: the DFlash authors' `dflash` package (installed with
//! transformers and torch by scripts/reference/venv.sh into `.cache`) loads
//! our export unmodified; its first-block logits equal our forward's for the
//! same target features and block, and its `dflash_generate` decodes every
//! prompt to the tokens of our `eval` (and of transformers' own greedy
//! decoding) with the same acceptance at every verify step.

#![allow(clippy::unwrap_used)] // tests panic on failure by design

use std::process::Command;
use std::time::Duration;

use dflash_tests::{Workspace, bin, reference_json, reference_python};

/// Relative tolerance of the first-block logits: both sides compute in f32
/// from the same bf16 weights; what differs is the order of the sums.
const LOGITS_TOLERANCE: f64 = 1e-4;

#[test]
fn the_dflash_package_loads_our_export_and_decodes_exactly_as_our_eval() {
    decodes_as_the_package(Workspace::synthetic(240, 6), "[drafter]\nnum_layers = 2\n", None);
}

/// A hybrid MoE target (Qwen3.5 MoE layers: Gated DeltaNet and gated
/// attention, routed and shared experts): `dflash up` captures it and
/// trains on it, our eval decodes with its recurrent cache, and the
/// package, with transformers' own Qwen3.5 MoE as the target, decodes the
/// export to the same tokens with the same acceptance at every step.
#[test]
fn a_drafter_of_a_hybrid_moe_target_decodes_exactly_as_the_package_reads_it() {
    decodes_as_the_package(Workspace::synthetic_shape(240, "tiny-hybrid"), "[drafter]\nnum_layers = 2\n", None);
}

/// A gpt-oss target (attention sinks, sliding-window and full layers,
/// clamped-SwiGLU experts with biases): `dflash up` captures it and trains
/// on it, our eval decodes with its windowed, sinked cache, and the package,
/// with transformers' own GptOss as the target, decodes the export to the
/// same tokens with the same acceptance at every step. Five steps at any
/// lr tried (6e-4 to 0.1) leave this drafter proposing the data's most
/// frequent token everywhere, so the proposals compared are one token; the
/// first-block logits (every vocabulary entry, six prompts) carry the
/// comparison.
#[test]
fn a_drafter_of_a_gpt_oss_target_decodes_exactly_as_the_package_reads_it() {
    let ws = Workspace::synthetic_shape(240, "tiny-gpt-oss");
    decodes_as_the_package_with(ws, "[drafter]\nnum_layers = 2\n", None, 1);
}

/// A drafter with a sliding-attention layer (window 8: shorter than every
/// prompt, so the window bounds what its slots see) and a full one.
#[test]
fn a_sliding_window_drafter_decodes_exactly_as_the_package_reads_it() {
    let drafter =
        "[drafter]\nnum_layers = 2\nlayer_types = [\"sliding_attention\", \"full_attention\"]\nsliding_window = 8\n";
    decodes_as_the_package(Workspace::synthetic(240, 6), drafter, Some(8));
}

/// DFlash2 (the published shape but for a smaller selector rank): the
/// package's `DFlash2DraftModel` reads the export's convolutions and
/// selector, its block logits equal ours, and its selector walk proposes
/// what ours does at every verify step. A high learning rate for the five
/// steps moves the convolutions and the selector far from their identity
/// start, so that the walk differs from the top logits somewhere.
#[test]
fn a_dflash2_drafter_decodes_exactly_as_the_package_reads_it() {
    let drafter = "[drafter]\nnum_layers = 2\nvariant = \"dflash2\"\nselector_rank = 32\n\
                   [training]\nlr = 0.05\nwarmup_ratio = 0.0\n";
    decodes_as_the_package(Workspace::synthetic(240, 6), drafter, None);
}

/// DFlash2 with a sliding-attention layer: the package must read both the
/// convolutions and selector and the layer's window. At the other DFlash2
/// test's lr (0.05) this drafter's five steps left it proposing one token
/// everywhere, so the selector never moved; 0.1 moves it.
#[test]
fn a_sliding_window_dflash2_drafter_decodes_exactly_as_the_package_reads_it() {
    let drafter = "[drafter]\nnum_layers = 2\nvariant = \"dflash2\"\nselector_rank = 32\n\
                   layer_types = [\"sliding_attention\", \"full_attention\"]\nsliding_window = 8\n\
                   [training]\nlr = 0.1\nwarmup_ratio = 0.0\n";
    decodes_as_the_package(Workspace::synthetic(240, 6), drafter, Some(8));
}

/// Trains a drafter on the workspace's target with `extra` config, exports
/// it, and checks the package against our eval; `window`: the sliding
/// window the export must name.
fn decodes_as_the_package(ws: Workspace, extra: &str, window: Option<i64>) {
    decodes_as_the_package_with(ws, extra, window, 2);
}

/// [`decodes_as_the_package`], with at least `distinct` different tokens
/// among the proposals compared.
fn decodes_as_the_package_with(ws: Workspace, extra: &str, window: Option<i64>, distinct: usize) {
    let dflash2 = extra.contains("dflash2");
    // The venv is installed (once per machine) before anything is trained.
    reference_python();
    // The synthetic target ties its embeddings, so its greedy outputs
    // repeat the prompt's last token: what five steps teach a drafter, so
    // that it accepts more than one token and DFlash2's selector moves. An
    // untied target's varied outputs leave a five-step drafter proposing one
    // token everywhere (acceptance 1 at every step), which compares less.
    // The logits comparison below does not depend on the outputs.
    // What is compared is the export, not what training taught it: five
    // steps. (On a random target a drafter soon proposes its few most
    // frequent tokens; the logits comparison below is the exact one.)
    let config = ws.config("client", &format!("[run]\nmax_steps = 5\n{extra}"));
    let mut up = dflash_tests::up(&ws, &config, &["--no-final-eval"], &[]);
    assert!(up.expect_exit(Duration::from_secs(240)).success(), "{}", up.log_text());
    let latest = std::fs::read_to_string(ws.path("checkpoints/latest")).unwrap();
    let export = ws.path("checkpoints").join(latest.trim());
    let card = std::fs::read_to_string(export.join("README.md")).unwrap();
    let class = if dflash2 { "DFlash2DraftModel" } else { "DFlashDraftModel" };
    assert!(card.contains(&format!("import {class},")) && card.contains("\"method\": \"dflash\""), "{card}");
    let exported: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(export.join("config.json")).unwrap()).unwrap();
    assert_eq!(exported["architectures"], serde_json::json!([class]));
    if dflash2 {
        let dc = &exported["dflash_config"];
        assert_eq!(
            (&dc["block_size"], &dc["conv_kernel_size"], &dc["conv_group_size"]),
            (&8.into(), &2.into(), &16.into())
        );
        assert_eq!((&dc["selector_rank"], &dc["selector_top_k"]), (&32.into(), &16.into()));
    }
    match window {
        Some(w) => {
            assert_eq!(exported["sliding_window"], w);
            assert_eq!(exported["use_sliding_window"], true);
            assert_eq!(exported["layer_types"], serde_json::json!(["sliding_attention", "full_attention"]));
        }
        None => assert!(exported.get("layer_types").is_none(), "{exported}"),
    }

    let eval_json = ws.path("eval.json");
    let eval = Command::new(bin("dflash"))
        .args(["eval", "--target"])
        .arg(ws.path("model"))
        .arg("--drafter")
        .arg(&export)
        .arg("--prompts")
        .arg(ws.path("data.jsonl"))
        .args(["--offset", "200", "--limit", "6", "--max-new-tokens", "40", "--block-logits", "6", "--threads", "1"])
        .arg("--json")
        .arg(&eval_json)
        .output()
        .unwrap();
    assert!(eval.status.success(), "{}", String::from_utf8_lossy(&eval.stderr));

    // Our own decoding and our training layout agree at every verify step.
    let ours: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&eval_json).unwrap()).unwrap();
    let trained = ours["reports"].as_array().unwrap().iter().find(|r| r["label"] == "trained").unwrap();
    assert_eq!(trained["step_agreement"], 1.0, "{trained}");
    assert_eq!(trained["lossless"], true, "{trained}");

    let r = reference_json("public_client.py", [ws.path("model"), export.clone(), eval_json.clone()]);
    println!("{}", serde_json::to_string(&r).unwrap());

    assert_eq!(r["architecture"], class);
    if dflash2 {
        assert!(r["selector_moved"].as_u64().unwrap() >= 1, "the selector never changed a proposal: {r}");
    }
    let windows = match window {
        Some(w) => serde_json::json!([w, null]),
        None => serde_json::json!([null, null]),
    };
    assert_eq!(r["layer_windows"], windows, "the package read other layer windows");
    assert_eq!(r["layer_causal"], serde_json::json!([window.is_some(), false]));
    let prompts = r["prompts"].as_array().unwrap();
    assert_eq!(prompts.len(), 6);
    let mut proposed = std::collections::BTreeSet::new();
    for p in prompts {
        assert_eq!(p["tokens_equal"], true, "the package decoded other tokens: {p}");
        assert_eq!(p["equals_transformers_greedy"], true, "{p}");
        let ours: Vec<u64> = p["ours_per_step"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
        let theirs: Vec<u64> = p["theirs_per_step"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
        assert_eq!(ours.len(), theirs.len(), "{p}");
        // Once fewer tokens are left than a block, the package drafts a
        // shorter block (ours drafts a whole one and keeps what fits):
        // compare the steps with whole blocks.
        let full = p["full_block_steps"].as_u64().unwrap() as usize;
        assert!(full >= 4, "{p}");
        assert_eq!(ours[..full], theirs[..full], "acceptance per verify step differs: {p}");
        let (our_props, their_props) =
            (p["ours_proposals"].as_array().unwrap(), p["theirs_proposals"].as_array().unwrap());
        assert_eq!(our_props[..full], their_props[..full], "the drafter proposed other tokens: {p}");
        proposed
            .extend(our_props[..full].iter().flat_map(|b| b.as_array().unwrap().iter().map(|t| t.as_u64().unwrap())));
    }
    // A drafter that always proposed one token would compare little.
    assert!(proposed.len() >= distinct, "proposals {proposed:?}: too few distinct tokens to compare");
    let blocks = r["block_logits"].as_array().unwrap();
    assert_eq!(blocks.len(), 6);
    for b in blocks {
        let (diff, scale) = (b["max_abs_diff"].as_f64().unwrap(), b["max_abs"].as_f64().unwrap());
        assert!(diff <= LOGITS_TOLERANCE * scale.max(1.0), "first-block logits differ by {diff} (scale {scale}): {b}");
        assert_eq!(b["argmax_equal"], true, "{b}");
    }
}
