//! Decoding against references: speculative decoding must reproduce greedy
//! decoding token for token (whatever the drafter proposes), and batched
//! generation with left padding must equal one-by-one generation.

#![allow(clippy::unwrap_used)] // tests panic on failure by design

use dflash_models::generate::{SpecSettings, greedy_generate, speculative_generate};
use dflash_models::synthetic::{synthetic_target_config, write_synthetic_target};
use dflash_models::{Drafter, DrafterConfig, LoadScope, TargetModel};
use tch::{Device, Kind};

fn target() -> (tempfile::TempDir, TargetModel) {
    let dir = tempfile::tempdir().unwrap();
    write_synthetic_target(dir.path(), &synthetic_target_config(3), 7).unwrap();
    let t = TargetModel::load(dir.path(), Device::Cpu, Kind::Float, LoadScope::Full).unwrap();
    (dir, t)
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
    let (_d, t) = target();
    for (seed, block) in [(1i64, 4i64), (2, 8)] {
        tch::manual_seed(seed);
        let dc = DrafterConfig::for_target(&t.config, 1, block, 3, vec![0, 2]);
        let drafter = Drafter::new(dc, Device::Cpu, Kind::Float);
        let prompt: Vec<u32> = (30..50).collect();
        let want = greedy_generate(&t, std::slice::from_ref(&prompt), 40, &[]);
        let s =
            SpecSettings { embed: t.embed_tokens(), lm_head: t.lm_head().unwrap(), max_new_tokens: 40, stop_ids: &[] };
        let got = speculative_generate(&t, &drafter, &prompt, &s);
        assert_eq!(got.tokens, want[0], "block {block}");
        assert!(got.tau() >= 1.0 && got.tau() <= block as f64);
        assert_eq!(1 + got.per_step.iter().sum::<u32>() as usize, got.tokens.len());
    }
}
