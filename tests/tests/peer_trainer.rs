//! The peer trainer's objective: SpecForge 0.2.0's own `OnlineDFlashModel`
//! (installed by scripts/reference/venv.sh into `.cache`) and our trainer
//! compute the same loss, accuracy and gradient norm for the same drafter
//! weights on the same batch. Our first logged step is read from `dflash up`
//! (the whole path: target capture, wire, blocks, micro-batches, backward);
//! SpecForge's comes from scripts/reference/specforge_loss.py on features
//! transformers computes. Every valid position is an anchor on both sides,
//! so nothing random is left to differ. Cross-entropy with the slot decay at
//! blocks 8 and 16, sliding-window layers, and D-PACE (SpecForge's has
//! another normalisation) are checked; KD and DFlash2 have no SpecForge
//! counterpart (specforge 0.2.0 ships neither).

#![allow(clippy::unwrap_used)] // tests panic on failure by design

use std::time::Duration;

use dflash_tests::{Workspace, reference_json, reference_python};

/// Relative tolerance of loss, accuracy and gradient norm, on top of half the
/// log's last printed digit: both sides compute in f32 from the same
/// weights; what differs is the order of the sums.
const TOLERANCE: f64 = 1e-4;

#[test]
fn specforges_objective_gives_our_loss_and_gradient_for_the_same_weights_and_batch() {
    same_objective_as_specforge(8, Some(4.0), "", "");
}

/// Block 16 with a slower slot decay: more slots past a sequence's end and
/// past its loss mask, where the two must agree on what counts.
#[test]
fn specforges_objective_agrees_at_block_16() {
    same_objective_as_specforge(16, Some(7.0), "", "");
}

/// Sliding-window layers: SpecForge builds their mask itself.
#[test]
fn specforges_objective_agrees_with_sliding_window_layers() {
    same_objective_as_specforge(
        8,
        Some(4.0),
        "layer_types = [\"sliding_attention\", \"full_attention\"]\nsliding_window = 8\n",
        "",
    );
}

/// D-PACE (alpha 0.5): SpecForge divides the weighted sum by the batch's
/// sequence count, ours by its supervised slots; the weights must agree.
#[test]
fn specforges_dpace_gives_our_loss_and_gradient_up_to_its_normalisation() {
    same_objective_as_specforge(8, None, "", "loss = \"dpace\"\n");
}

/// One step of ours against SpecForge's objective: `gamma` the slot decay
/// (None: D-PACE, which weighs slots itself), extra `[drafter]` and
/// `[training]` settings.
fn same_objective_as_specforge(block: usize, gamma: Option<f64>, drafter_extra: &str, training_extra: &str) {
    // The venv is installed (once per machine) before anything is trained.
    reference_python();
    let ws = Workspace::synthetic(24, 6);
    let dpace = gamma.is_none();
    let decay = gamma.map_or(String::new(), |g| format!("gamma = {g}\n"));
    let drafter = format!("[drafter]\nnum_layers = 2\nblock_size = {block}\n{decay}{drafter_extra}");
    // One batch of every conversation, every valid position an anchor (two
    // micro-batches of blocks).
    let one_batch = format!(
        "[training]\nanchors_per_sequence = 512\nmax_blocks_per_micro_batch = 512\n{training_extra}\
         [pipeline]\ntoken_budget = 16384\nmax_batch_size = 64\n"
    );

    // Weights to compare on: a drafter trained for 40 steps, far enough
    // from its random start that its slots' losses differ (at the start
    // every slot costs about the same, and an error in the labels or the
    // slot weights would hardly show).
    let training = one_batch.replacen("[training]\n", "[training]\nlr = 3e-3\nwarmup_ratio = 0.0\n", 1);
    let first = ws.config("weights", &format!("[run]\nmax_steps = 40\nepochs = 100\n{drafter}{training}"));
    let mut up = dflash_tests::up(&ws, &first, &["--no-final-eval"], &[]);
    assert!(up.expect_exit(Duration::from_secs(240)).success(), "{}", up.log_text());
    let latest = std::fs::read_to_string(ws.path("checkpoints/latest")).unwrap();
    let export = ws.path("checkpoints").join(latest.trim());
    let saved = ws.path("weights");
    std::fs::rename(&export, &saved).unwrap();
    std::fs::remove_dir_all(ws.path("checkpoints")).unwrap();
    std::fs::remove_dir_all(ws.path("up")).unwrap();

    // Our first step from those weights.
    let drafter_from = drafter.replacen("[drafter]\n", &format!("[drafter]\ninit_from = \"{}\"\n", saved.display()), 1);
    let second = ws.config("ours", &format!("[run]\nmax_steps = 1\n{drafter_from}{one_batch}"));
    let mut up = dflash_tests::up(&ws, &second, &["--no-final-eval"], &[]);
    assert!(up.expect_exit(Duration::from_secs(240)).success(), "{}", up.log_text());
    let log = up.log_text();
    assert!(log.contains("initialised the drafter from"), "{log}");
    let line = log.lines().find(|l| l.contains("step 1/1 |")).unwrap_or_else(|| panic!("no step line:\n{log}"));
    // A logged value and half its last printed digit (the log rounds).
    let field = |name: &str| -> (f64, f64) {
        let text = line.split(" | ").find_map(|p| p.trim().strip_prefix(&format!("{name} "))).unwrap().trim();
        let decimals = text.split_once('.').map_or(0, |(_, d)| d.len()) as i32;
        (text.parse().unwrap_or_else(|_| panic!("{name} in {line}")), 0.5 * 10f64.powi(-decimals))
    };
    let ((loss, loss_digit), (acc, acc_digit), (grad, grad_digit)) = (field("loss"), field("acc"), field("grad"));

    let data = ws.path("data.jsonl");
    let mut args = vec![ws.path("model").into_os_string(), saved.into_os_string(), data.into_os_string()];
    args.extend(["--max-seq-len", "256"].map(Into::into));
    match gamma {
        Some(g) => args.extend(["--gamma".into(), g.to_string().into()]),
        None => args.extend(["--loss", "dpace", "--dpace-alpha", "0.5"].map(Into::into)),
    }
    let theirs = reference_json("specforge_loss.py", args);
    println!("ours: loss {loss} acc {acc} grad {grad}; SpecForge: {theirs}");
    assert_eq!(theirs["samples"], 24, "SpecForge kept other conversations: {theirs}");
    // SpecForge's D-PACE is a sum over the batch's sequences; ours a mean
    // over its supervised slots.
    let scale =
        if dpace { theirs["samples"].as_f64().unwrap() / theirs["supervised_slots"].as_f64().unwrap() } else { 1.0 };
    let (their_loss, their_acc, their_grad) = (
        theirs["loss"].as_f64().unwrap() * scale,
        theirs["acc"].as_f64().unwrap(),
        theirs["grad_norm"].as_f64().unwrap() * scale,
    );
    assert!(their_acc > 0.2, "the drafter learned too little for the comparison to mean much: {theirs}");
    let close = |ours: f64, theirs: f64, digit: f64| (ours - theirs).abs() <= TOLERANCE * theirs.abs() + digit;
    assert!(close(loss, their_loss, loss_digit), "loss {loss} against SpecForge's {their_loss}");
    assert!(close(grad, their_grad, grad_digit), "gradient norm {grad} against SpecForge's {their_grad}");
    assert!(close(acc, their_acc, acc_digit), "accuracy {acc} against SpecForge's {their_acc}");
}
