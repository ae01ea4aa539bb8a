//! Decoding against references: speculative decoding must reproduce greedy
//! decoding token for token (whatever the drafter proposes), and batched
//! generation with left padding must equal one-by-one generation.

#![allow(clippy::unwrap_used)] // tests panic on failure by design

use dflash_models::acceptance::{SlotScores, block_predictions};
use dflash_models::generate::{SpecSettings, block_logits_at, greedy_generate, speculative_generate};
use dflash_models::synthetic::{synthetic_target_config, write_synthetic_target};
use dflash_models::{Drafter, DrafterConfig, LayerType, LoadScope, TargetModel};
use tch::{Device, Kind};

/// The synthetic target with an untied LM head: tied embeddings on random
/// weights make it repeat its last token forever (each token's own
/// embedding scores highest), and an output of one repeated token would let
/// a token read at the wrong position pass. Untied, its greedy outputs vary.
fn target() -> (tempfile::TempDir, TargetModel) {
    target_of(untied(synthetic_target_config(3)))
}

fn untied(c: dflash_models::TargetConfig) -> dflash_models::TargetConfig {
    dflash_models::TargetConfig { tie_word_embeddings: false, ..c }
}

fn target_of(config: dflash_models::TargetConfig) -> (tempfile::TempDir, TargetModel) {
    let dir = tempfile::tempdir().unwrap();
    write_synthetic_target(dir.path(), &config, 7).unwrap();
    let t = TargetModel::load(dir.path(), Device::Cpu, Kind::Float, LoadScope::Full).unwrap();
    (dir, t)
}

/// A freshly initialised drafter (seeded) reading target layers 0 and 2.
fn drafter(t: &TargetModel, seed: i64, layers: i64, block: i64) -> Drafter {
    sliding_drafter(t, seed, layers, block, None)
}

/// With `window`, layer 0 slides over that many positions, the rest attend fully.
fn sliding_drafter(t: &TargetModel, seed: i64, layers: i64, block: i64, window: Option<i64>) -> Drafter {
    tch::manual_seed(seed);
    let mut c = DrafterConfig::for_target(&t.config, layers, block, 3, vec![0, 2]);
    if let Some(w) = window {
        c.layer_types =
            (0..layers).map(|i| if i == 0 { LayerType::SlidingAttention } else { LayerType::FullAttention }).collect();
        c.sliding_window = Some(w);
    }
    Drafter::new(c, Device::Cpu, Kind::Float)
}

fn settings(t: &TargetModel, max_new_tokens: usize) -> SpecSettings<'_> {
    SpecSettings { embed: t.embed_tokens(), lm_head: t.lm_head().unwrap(), max_new_tokens, stop_ids: &[] }
}

#[test]
fn batched_greedy_equals_one_by_one() {
    let (_d, t) = target();
    let prompts: Vec<Vec<u32>> = vec![(20..31).collect(), (40..44).collect(), (100..120).collect()];
    let together = greedy_generate(&t, &prompts, 12, &[]);
    for (p, got) in prompts.iter().zip(&together) {
        let alone = greedy_generate(&t, std::slice::from_ref(p), 12, &[]);
        assert_eq!(got, &alone[0]);
        assert_eq!(got.len(), 12);
    }
}

#[test]
fn speculative_decoding_reproduces_greedy_decoding() {
    let moe = dflash_models::synthetic::shape_preset("tiny-moe").unwrap();
    for (_d, t) in [target(), target_of(untied(moe))] {
        speculative_equals_greedy(&t);
    }
}

fn speculative_equals_greedy(t: &TargetModel) {
    for (seed, block) in [(1i64, 4i64), (2, 8)] {
        let drafter = drafter(t, seed, 1, block);
        let prompt: Vec<u32> = (30..50).collect();
        let want = greedy_generate(t, std::slice::from_ref(&prompt), 40, &[]);
        let got = speculative_generate(t, &drafter, &prompt, &settings(t, 40));
        assert_eq!(got.tokens, want[0], "block {block}");
        assert!(got.tau() >= 1.0 && got.tau() <= block as f64);
        assert_eq!(1 + got.per_step.iter().sum::<u32>() as usize, got.tokens.len());
    }
}

#[test]
fn decoding_proposes_what_the_training_layout_predicts_at_the_same_anchors() {
    // The drafter sees the same inputs in training (packed features of the
    // whole sequence, block layout, mask) and in decoding (features grown
    // by each verify step): its proposals at every anchor decoding visits
    // must be the same tokens.
    let (_d, t) = target();
    // The last case has a sliding layer whose window (10) is shorter than
    // the sequence: training and decoding must bound it the same way.
    for (seed, block, window) in [(3i64, 4i64, None), (4, 8, None), (5, 4, Some(10))] {
        let drafter = sliding_drafter(&t, seed, 2, block, window);
        let prompt: Vec<u32> = (60..75).collect();
        let got = speculative_generate(&t, &drafter, &prompt, &settings(&t, 48));
        assert!(got.steps.len() >= 6, "{} steps", got.steps.len());
        let seq: Vec<u32> = prompt.iter().chain(&got.tokens).copied().collect();
        let mask: Vec<u8> = (0..seq.len()).map(|i| u8::from(i >= prompt.len())).collect();
        let anchors: Vec<usize> = got.steps.iter().map(|st| st.anchor).collect();
        for (st, tokens_before) in got.steps.iter().zip(got.per_step.iter().scan(1usize, |n, &p| {
            let before = *n;
            *n += p as usize;
            Some(before)
        })) {
            assert_eq!(st.anchor, prompt.len() + tokens_before - 1, "the anchor is the last token produced");
            assert_eq!(seq[st.anchor], got.tokens[tokens_before - 1]);
        }
        let pred = block_predictions(&t, &drafter, t.embed_tokens(), t.lm_head().unwrap(), &seq, &mask, &anchors);
        for (i, st) in got.steps.iter().enumerate() {
            assert_eq!(st.proposal, pred.proposals[i], "block {block}, step {i} at anchor {}", st.anchor);
        }
        let accepted = pred.accepted(&seq, &mask);
        for (st, a) in got.steps.iter().zip(&accepted) {
            if st.anchor + (block as usize) < seq.len() {
                assert_eq!(st.accepted, *a, "anchor {}", st.anchor);
            }
        }
    }
}

#[test]
fn the_layouts_slot_scores_equal_decodings_block_logits_at_every_anchor() {
    // `eval`'s held-out cross-entropy and accuracy read the training
    // layout's logits at every anchor of an output; decoding drafts each
    // block on its own (features of the prefix, block [anchor token,
    // MASK...]). Both must give the output's tokens the same
    // log-probabilities, and the scores must count exactly the slots inside
    // the sequence and the loss mask. The output is arbitrary tokens, not
    // greedy's: the layout scores any sequence.
    let (_d, t) = target();
    let vocab = t.config.vocab_size as u32;
    for (seed, block, window) in [(6i64, 4i64, None), (7, 8, Some(10))] {
        let drafter = sliding_drafter(&t, seed, 2, block, window);
        // A fresh drafter's logits are nearly uniform (every token about
        // -ln(vocab)); widening the final norm spreads them.
        let norm = drafter.named_parameters().into_iter().find(|(n, _)| n == "norm.weight").unwrap().1;
        tch::no_grad(|| {
            let _ = norm.shallow_clone().fill_(30.0);
        });
        let prompt: Vec<u32> = (80..92).collect();
        let output: Vec<u32> = (0..24u32).map(|i| (i * 37 + 11) % vocab).collect();
        let seq: Vec<u32> = prompt.iter().chain(&output).copied().collect();
        // The last 3 tokens are outside the loss mask (as an end-of-turn
        // suffix would be when a template masks it).
        let mask: Vec<u8> = (0..seq.len()).map(|i| u8::from(i >= prompt.len() && i + 3 < seq.len())).collect();
        let anchors: Vec<usize> = (prompt.len()..seq.len() - 1).collect();
        let pred = block_predictions(&t, &drafter, t.embed_tokens(), t.lm_head().unwrap(), &seq, &mask, &anchors);
        let s = settings(&t, 1);
        let mut want = SlotScores::default();
        let mut spread = (f64::MAX, f64::MIN);
        for (i, &a) in anchors.iter().enumerate() {
            let logits = block_logits_at(&t, &drafter, &seq[..a], seq[a], &s).to_kind(Kind::Double);
            let lp = logits.log_softmax(-1, Kind::Double);
            for k in 0..(block as usize - 1) {
                let pos = a + k + 1;
                let got = pred.label_log_probs[i][k];
                if pos >= seq.len() {
                    assert!(got.is_nan(), "anchor {a} slot {k} is past the end: {got}");
                    continue;
                }
                let expected = lp.double_value(&[k as i64, i64::from(seq[pos])]);
                spread = (spread.0.min(expected), spread.1.max(expected));
                assert!(
                    (f64::from(got) - expected).abs() < 1e-4,
                    "block {block}, anchor {a}, slot {k}: layout {got}, decoding {expected}"
                );
                assert_eq!(pred.proposals[i][k], logits.get(k as i64).argmax(-1, false).int64_value(&[]) as u32);
                if mask[pos] == 1 {
                    want.slots += 1;
                    want.cross_entropy_sum -= expected;
                    want.correct += u64::from(pred.proposals[i][k] == seq[pos]);
                }
            }
        }
        assert!(spread.1 - spread.0 > 1.0, "the log-probabilities must differ to tell slots apart: {spread:?}");
        let got = pred.slot_scores(&seq, &mask, &(0..anchors.len()).collect::<Vec<_>>());
        assert_eq!((got.slots, got.correct), (want.slots, want.correct), "block {block}");
        assert!(got.slots > 0 && got.slots < (anchors.len() * (block as usize - 1)) as u64);
        assert!((got.cross_entropy_sum - want.cross_entropy_sum).abs() < 1e-4 * got.slots as f64);
        let (ce, acc) = got.means().unwrap();
        assert!(ce > 0.0 && (0.0..=1.0).contains(&acc));
    }
}
