//! Acceptance length by real speculative decoding: the drafter proposes,
//! the target verifies, and tau counts tokens per target forward. Used by
//! `dflash eval` and by the drafter's periodic evaluation during training.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::time::{Duration, Instant};

use dflash_data::{ChatTokenizer, Conversation};
use serde::Serialize;
use tch::Tensor;

use crate::acceptance::{SlotScores, block_predictions};
use crate::blocks::anchor_candidates;
use crate::generate::{SpecResult, SpecSettings, greedy_generate, speculative_generate};
use crate::{Drafter, ModelError, TargetModel};

/// A held-out prompt.
pub struct EvalPrompt {
    pub id: String,
    pub category: String,
    pub ids: Vec<u32>,
}

/// Which prompts of a file an evaluation decodes, in file order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PromptPick {
    /// Skip this many records first (e.g. the prompts a drafter trained on).
    pub offset: usize,
    /// Take at most this many (0: all).
    pub limit: usize,
    /// Take at most this many of each `category` (0: no cap), so that a
    /// file sorted by category is sampled across all of them.
    pub per_category: usize,
}

/// Reads prompts (JSONL chat lines with optional `id` and `category`).
pub fn read_prompts(path: &Path, tok: &ChatTokenizer, pick: PromptPick) -> Result<Vec<EvalPrompt>, ModelError> {
    let mut out = Vec::new();
    let mut taken: BTreeMap<String, usize> = BTreeMap::new();
    for (i, record) in prompt_records(path)?.into_iter().skip(pick.offset) {
        if pick.limit > 0 && out.len() == pick.limit {
            break;
        }
        let Some(record) = record else { continue };
        let bad = |e: String| ModelError::Config { path: path.to_path_buf(), message: format!("{i}: {e}") };
        let v = record.map_err(bad)?;
        let category = v["category"].as_str().unwrap_or("all").to_string();
        let of_category = taken.entry(category.clone()).or_default();
        if pick.per_category > 0 && *of_category == pick.per_category {
            continue;
        }
        *of_category += 1;
        let id = match &v["id"] {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Null => i.number().to_string(),
            other => other.to_string(),
        };
        let conv = Conversation::from_json(v).map_err(bad)?;
        let ids = tok.encode_prompt(&conv.first_prompt()).map_err(|e| bad(e.to_string()))?;
        out.push(EvalPrompt { id, category, ids });
    }
    if out.is_empty() {
        let message = match pick.offset {
            0 => "has no prompts".to_string(),
            n => format!("has no prompts after the first {n}"),
        };
        return Err(ModelError::Config { path: path.to_path_buf(), message });
    }
    Ok(out)
}

/// Where a prompt record sits in its file: a JSONL line or a Parquet row
/// (both 1-based in messages; `number` is what a prompt without an `id` is
/// called).
#[derive(Clone, Copy, Debug)]
pub enum RecordAt {
    Line(usize),
    Row(usize),
}

impl RecordAt {
    pub fn number(self) -> usize {
        match self {
            RecordAt::Line(n) | RecordAt::Row(n) => n,
        }
    }
}

impl std::fmt::Display for RecordAt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RecordAt::Line(n) => write!(f, "line {n}"),
            RecordAt::Row(n) => write!(f, "row {n}"),
        }
    }
}

/// One record of a prompts file: where it is, and its JSON (None for a
/// blank line; an error for a line that is not JSON).
pub type PromptRecord = (RecordAt, Option<Result<serde_json::Value, String>>);

/// The records of a prompts file as JSON, one per JSONL line (a blank line
/// keeps its place, so that offsets count lines) or per Parquet row (the
/// chat column with `id` and `category` when present).
pub fn prompt_records(path: &Path) -> Result<Vec<PromptRecord>, ModelError> {
    if dflash_data::parquet_rows::is_parquet(path) {
        let rows = dflash_data::parquet_rows::chat_rows(path, &["id", "category"])
            .map_err(|e| ModelError::Config { path: path.to_path_buf(), message: e.to_string() })?;
        return Ok(rows.into_iter().enumerate().map(|(i, v)| (RecordAt::Row(i + 1), Some(Ok(v)))).collect());
    }
    let f = std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
    let mut out = Vec::new();
    for (i, line) in BufReader::new(f).lines().enumerate() {
        let line = line.map_err(|e| ModelError::io(path, e))?;
        let record = (!line.trim().is_empty()).then(|| serde_json::from_str(&line).map_err(|e| e.to_string()));
        out.push((RecordAt::Line(i + 1), record));
    }
    Ok(out)
}

/// Results of one evaluation.
#[derive(Clone, Debug, Serialize)]
pub struct EvalReport {
    pub label: String,
    pub tau: f64,
    pub tokens: u64,
    pub verify_steps: u64,
    pub seconds: f64,
    pub tokens_per_s: f64,
    pub per_category: BTreeMap<String, f64>,
    pub per_prompt: Vec<(String, f64)>,
    /// Every output equalled plain greedy decoding (checked when a
    /// baseline was decoded).
    pub lossless: Option<bool>,
    /// Simulated acceptance (the training step's measure) over every valid
    /// anchor of the prompts' greedy outputs (the reference when one was
    /// given, else decoding's own output, which is greedy's).
    pub simulated_tau: Option<f64>,
    /// Over the same anchors, every drafted slot inside the greedy output:
    /// the drafter's mean cross-entropy on the output's token (nats, no slot
    /// weights) and how often its proposal is that token -- the held-out
    /// counterparts of the step log's loss and accuracy.
    pub slot_cross_entropy: Option<f64>,
    pub slot_accuracy: Option<f64>,
    /// Fraction of verify steps whose accepted count equals the training
    /// layout's at the same anchor (1.0 unless training and decoding see
    /// the drafter's inputs differently).
    pub step_agreement: Option<f64>,
    /// What each prompt's decoding did, for clients that replay it (the
    /// public-client test decodes the same prompts with the `dflash` package).
    pub decodes: Vec<PromptDecode>,
}

/// One prompt's speculative decoding, token by token.
#[derive(Clone, Debug, Serialize)]
pub struct PromptDecode {
    pub id: String,
    pub prompt_ids: Vec<u32>,
    /// The generated tokens (greedy's, by construction).
    pub tokens: Vec<u32>,
    /// Tokens each verify step produced (accepted + bonus).
    pub per_step: Vec<u32>,
    /// The drafter's proposal at each verify step.
    pub proposals: Vec<Vec<u32>>,
}

/// Decodes every prompt speculatively and measures tau.
// The inputs of one evaluation are independent; a struct would only rename them.
#[allow(clippy::too_many_arguments)]
pub fn evaluate(
    label: &str,
    target: &TargetModel,
    drafter: &Drafter,
    embed: &Tensor,
    lm_head: &Tensor,
    prompts: &[EvalPrompt],
    max_new_tokens: usize,
    stop_ids: &[u32],
    reference: Option<&[Vec<u32>]>,
    progress: &mut dyn FnMut(),
) -> EvalReport {
    let s = SpecSettings { embed, lm_head, max_new_tokens, stop_ids };
    let mut steps = 0u64;
    let mut tokens = 0u64;
    let mut elapsed = Duration::ZERO;
    let mut cats: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    let mut per_prompt = Vec::with_capacity(prompts.len());
    let mut decodes = Vec::with_capacity(prompts.len());
    let mut lossless = true;
    let mut check = LayoutCheck::default();
    for (i, p) in prompts.iter().enumerate() {
        let r = speculative_generate(target, drafter, &p.ids, &s);
        // The layout check reads the greedy output: the reference where one
        // was decoded, else decoding's own (greedy by construction).
        let output = match reference {
            Some(refs) => {
                lossless &= refs[i] == r.tokens;
                &refs[i]
            }
            None => &r.tokens,
        };
        check.add(target, drafter, (embed, lm_head), &p.ids, output, &r);
        let produced: u64 = r.per_step.iter().map(|&n| n as u64).sum();
        steps += r.per_step.len() as u64;
        tokens += produced;
        elapsed += r.elapsed;
        let e = cats.entry(p.category.clone()).or_default();
        e.0 += produced as f64;
        e.1 += r.per_step.len() as f64;
        per_prompt.push((p.id.clone(), r.tau()));
        decodes.push(PromptDecode {
            id: p.id.clone(),
            prompt_ids: p.ids.clone(),
            proposals: r.steps.iter().map(|st| st.proposal.clone()).collect(),
            tokens: r.tokens,
            per_step: r.per_step,
        });
        progress();
    }
    let slot_means = check.slots.means();
    EvalReport {
        label: label.to_string(),
        tau: tokens as f64 / steps.max(1) as f64,
        tokens,
        verify_steps: steps,
        seconds: elapsed.as_secs_f64(),
        tokens_per_s: tokens as f64 / elapsed.as_secs_f64().max(1e-9),
        per_category: cats.into_iter().map(|(k, (t, n))| (k, t / n.max(1.0))).collect(),
        per_prompt,
        lossless: reference.map(|_| lossless),
        simulated_tau: (check.sim_anchors > 0).then(|| check.sim_sum / check.sim_anchors as f64),
        slot_cross_entropy: slot_means.map(|(ce, _)| ce),
        slot_accuracy: slot_means.map(|(_, acc)| acc),
        step_agreement: (check.compared > 0).then(|| check.agreed as f64 / check.compared as f64),
        decodes,
    }
}

/// Decoding set against the training step's view of the same sequence:
/// simulated acceptance over every anchor of a greedy output, and how many
/// verify steps accepted exactly what the training layout predicts there.
#[derive(Default)]
struct LayoutCheck {
    sim_sum: f64,
    sim_anchors: usize,
    agreed: usize,
    compared: usize,
    slots: SlotScores,
}

impl LayoutCheck {
    /// Adds one prompt: its greedy `output` and its speculative decoding `r`.
    fn add(
        &mut self,
        target: &TargetModel,
        drafter: &Drafter,
        (embed, lm_head): (&Tensor, &Tensor),
        prompt: &[u32],
        output: &[u32],
        r: &SpecResult,
    ) {
        let seq: Vec<u32> = prompt.iter().chain(output).copied().collect();
        let mask: Vec<u8> = (0..seq.len()).map(|j| u8::from(j >= prompt.len())).collect();
        let candidates = anchor_candidates(&mask);
        let mut anchors = candidates.clone();
        anchors.extend(r.steps.iter().map(|st| st.anchor).filter(|a| a + 1 < seq.len()));
        anchors.sort_unstable();
        anchors.dedup();
        let pred = block_predictions(target, drafter, embed, lm_head, &seq, &mask, &anchors);
        let at: BTreeMap<usize, u32> = anchors.iter().copied().zip(pred.accepted(&seq, &mask)).collect();
        self.sim_sum += candidates.iter().map(|a| 1.0 + f64::from(at[a])).sum::<f64>();
        self.sim_anchors += candidates.len();
        let candidate_rows: Vec<usize> =
            candidates.iter().map(|a| anchors.binary_search(a).expect("every candidate is an anchor")).collect();
        self.slots.add(pred.slot_scores(&seq, &mask, &candidate_rows));
        // Steps whose whole block lies inside the output: both sides see every slot.
        for st in r.steps.iter().filter(|st| st.anchor + drafter.config.block_size as usize <= seq.len()) {
            self.compared += 1;
            self.agreed += usize::from(at.get(&st.anchor) == Some(&st.accepted));
        }
    }
}

/// Plain greedy decoding of every prompt, one at a time: the reference
/// output and the speed speculative decoding is compared with.
pub fn greedy_reference(
    target: &TargetModel,
    prompts: &[EvalPrompt],
    max_new: usize,
    stop_ids: &[u32],
    progress: &mut dyn FnMut(),
) -> (Vec<Vec<u32>>, f64) {
    let t0 = Instant::now();
    let outs: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            let out = greedy_generate(target, std::slice::from_ref(&p.ids), max_new, stop_ids).remove(0);
            progress();
            out
        })
        .collect();
    let n: usize = outs.iter().map(Vec::len).sum();
    (outs, n as f64 / t0.elapsed().as_secs_f64())
}
