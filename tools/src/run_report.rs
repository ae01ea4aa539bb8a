//! The report `dflash up` ends with: per prompt set, the acceptance length
//! tau of the trained drafter beside an untrained one, the simulated
//! acceptance, the speed against greedy decoding, and what those numbers
//! mean on the machine that measured them. Read from the JSON files
//! `dflash eval` wrote, one per set.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context;
use serde::Deserialize;

/// What one `dflash eval --json` file says of one prompt set.
#[derive(Debug, Deserialize)]
pub struct SetResult {
    pub set: String,
    pub prompt_count: usize,
    pub categories: Vec<String>,
    pub greedy_tokens_per_s: f64,
    pub reports: Vec<DrafterResult>,
}

/// One drafter's decoding of the set.
#[derive(Debug, Deserialize)]
pub struct DrafterResult {
    pub label: String,
    pub tau: f64,
    pub tokens_per_s: f64,
    pub simulated_tau: Option<f64>,
    pub lossless: Option<bool>,
}

impl SetResult {
    pub fn read(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("{} is not a `dflash eval --json` report", path.display()))
    }

    fn drafter(&self, label: &str) -> Option<&DrafterResult> {
        self.reports.iter().find(|r| r.label == label)
    }
}

impl DrafterResult {
    fn speedup(&self, greedy_tps: f64) -> f64 {
        self.tokens_per_s / greedy_tps.max(1e-9)
    }
}

/// The final report: a table with one row per prompt set, then the
/// sentence that explains tau against speed here.
pub fn render(sets: &[SetResult], block_size: u32) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<28} {:>7} {:>10} {:>8} {:>10} {:>9} {:>10}",
        "prompt set", "prompts", "untrained", "trained", "simulated", "tok/s", "vs greedy"
    );
    for s in sets {
        let Some(trained) = s.drafter("trained") else { continue };
        let untrained = s.drafter("untrained").map_or_else(|| "-".to_string(), |u| format!("{:.2}", u.tau));
        let simulated = trained.simulated_tau.map_or_else(|| "-".to_string(), |t| format!("{t:.2}"));
        let name = match s.categories.len() {
            n if n > 1 => format!("{} ({n} categories)", s.set),
            _ => s.set.clone(),
        };
        let _ = writeln!(
            out,
            "{:<28} {:>7} {:>10} {:>8.2} {:>10} {:>9.1} {:>9.2}x{}",
            name,
            s.prompt_count,
            untrained,
            trained.tau,
            simulated,
            trained.tokens_per_s,
            trained.speedup(s.greedy_tokens_per_s),
            if trained.lossless == Some(false) { "  OUTPUT DIFFERS FROM GREEDY" } else { "" }
        );
    }
    let _ = writeln!(
        out,
        "tau: tokens each target forward produced in real speculative decoding (1.00: no draft accepted; \
         at most {block_size}, the block); simulated: the training step's estimate of it over every position \
         of the greedy answers."
    );
    // Each draft-and-verify step costs tau / speedup greedy steps: measured
    // here, it says why a CPU run can decode slower than greedy with tau > 1.
    let costs: Vec<String> = sets
        .iter()
        .filter_map(|s| {
            let t = s.drafter("trained")?;
            let speedup = t.speedup(s.greedy_tokens_per_s);
            (speedup > 0.0).then(|| format!("{:.1} ({})", t.tau / speedup, s.set))
        })
        .collect();
    if !costs.is_empty() {
        let _ = writeln!(
            out,
            "Why speed and tau differ here: one draft-and-verify step cost {} greedy decode steps, because on a \
             CPU the target computes a block of {block_size} tokens several times as slowly as one token, so \
             decoding beats greedy only where tau exceeds that cost. On a GPU, decoding is bound by reading the \
             weights and verifying a block costs about one decode step, so the speedup there approaches tau \
             (less the drafter's own small cost).",
            costs.join(", ")
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(name: &str, greedy: f64, untrained: f64, trained: f64, tps: f64) -> SetResult {
        let r = |label: &str, tau: f64, tokens_per_s: f64| DrafterResult {
            label: label.into(),
            tau,
            tokens_per_s,
            simulated_tau: Some(tau + 0.05),
            lossless: Some(true),
        };
        SetResult {
            set: name.into(),
            prompt_count: 16,
            categories: vec!["a".into(), "b".into()],
            greedy_tokens_per_s: greedy,
            reports: vec![r("untrained", untrained, tps / 2.0), r("trained", trained, tps)],
        }
    }

    #[test]
    fn the_report_has_a_row_per_set_and_the_measured_step_cost() {
        let text = render(&[set("chat", 20.0, 1.0, 1.5, 30.0), set("mt-bench", 20.0, 1.0, 1.2, 10.0)], 8);
        let rows: Vec<&str> = text.lines().collect();
        assert!(rows[1].starts_with("chat (2 categories)"), "{text}");
        assert!(rows[1].contains("1.00") && rows[1].contains("1.50") && rows[1].contains("1.55"), "{text}");
        assert!(rows[1].contains("1.50x"), "{text}");
        assert!(rows[2].contains("0.50x"), "{text}");
        // 1.5 / 1.5x = 1.0 greedy steps per verify step; 1.2 / 0.5x = 2.4.
        assert!(text.contains("cost 1.0 (chat), 2.4 (mt-bench) greedy decode steps"), "{text}");
        assert!(!text.contains("DIFFERS"), "{text}");
    }

    #[test]
    fn an_eval_file_that_is_not_a_report_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("eval.json");
        std::fs::write(&p, "{\"reports\": 3}").unwrap();
        let e = SetResult::read(&p).unwrap_err();
        assert!(format!("{e:#}").contains("eval.json"), "{e:#}");
    }
}
