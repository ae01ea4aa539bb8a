//! Acceptance length by real speculative decoding: the drafter proposes,
//! the target verifies, and tau counts tokens per target forward. Used by
//! `dflash-drafter eval` and periodically during training.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use dflash_data::{ChatTokenizer, Conversation};
use dflash_models::acceptance::block_predictions;
use dflash_models::blocks::anchor_candidates;
use dflash_models::generate::{SpecResult, SpecSettings, greedy_generate, speculative_generate};
use dflash_models::{Drafter, LoadScope, TargetModel};
use serde::Serialize;
use tch::{Device, Kind, Tensor};

/// A held-out prompt.
pub struct EvalPrompt {
    pub id: String,
    pub category: String,
    pub ids: Vec<u32>,
}

/// Reads prompts (JSONL chat lines with optional `id` and `category`).
pub fn read_prompts(path: &Path, tok: &ChatTokenizer, offset: usize, limit: usize) -> anyhow::Result<Vec<EvalPrompt>> {
    let f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in BufReader::new(f).lines().enumerate().skip(offset) {
        if limit > 0 && out.len() == limit {
            break;
        }
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let conv = Conversation::parse_line(&line).map_err(|e| anyhow::anyhow!("{}:{}: {e}", path.display(), i + 1))?;
        let v: serde_json::Value = serde_json::from_str(&line)?;
        let id = match &v["id"] {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Null => (i + 1).to_string(),
            other => other.to_string(),
        };
        let category = v["category"].as_str().unwrap_or("all").to_string();
        out.push(EvalPrompt { id, category, ids: tok.encode_prompt(&conv.first_prompt())? });
    }
    if out.is_empty() {
        anyhow::bail!("{}: no prompts", path.display());
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
    /// anchor of the prompts' greedy outputs, when those were given.
    pub simulated_tau: Option<f64>,
    /// Fraction of verify steps whose accepted count equals the training
    /// layout's at the same anchor (1.0 unless training and decoding see
    /// the drafter's inputs differently).
    pub step_agreement: Option<f64>,
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
) -> EvalReport {
    let s = SpecSettings { embed, lm_head, max_new_tokens, stop_ids };
    let mut steps = 0u64;
    let mut tokens = 0u64;
    let mut elapsed = Duration::ZERO;
    let mut cats: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    let mut per_prompt = Vec::with_capacity(prompts.len());
    let mut lossless = true;
    let mut check = LayoutCheck::default();
    for (i, p) in prompts.iter().enumerate() {
        let r = speculative_generate(target, drafter, &p.ids, &s);
        if let Some(refs) = reference {
            lossless &= refs[i] == r.tokens;
            check.add(target, drafter, (embed, lm_head), &p.ids, &refs[i], &r);
        }
        let produced: u64 = r.per_step.iter().map(|&n| n as u64).sum();
        steps += r.per_step.len() as u64;
        tokens += produced;
        elapsed += r.elapsed;
        let e = cats.entry(p.category.clone()).or_default();
        e.0 += produced as f64;
        e.1 += r.per_step.len() as f64;
        per_prompt.push((p.id.clone(), r.tau()));
    }
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
        simulated_tau: reference.map(|_| check.sim_sum / check.sim_anchors.max(1) as f64),
        step_agreement: reference.map(|_| check.agreed as f64 / check.compared.max(1) as f64),
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
) -> (Vec<Vec<u32>>, f64) {
    let t0 = Instant::now();
    let outs: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| greedy_generate(target, std::slice::from_ref(&p.ids), max_new, stop_ids).remove(0))
        .collect();
    let n: usize = outs.iter().map(Vec::len).sum();
    (outs, n as f64 / t0.elapsed().as_secs_f64())
}

#[derive(clap::Args, Debug)]
pub struct EvalArgs {
    /// Target model directory.
    #[arg(long)]
    pub target: PathBuf,
    /// Drafter checkpoint directory (config.json + model.safetensors), or a
    /// checkpoint root holding a `latest` pointer.
    #[arg(long)]
    pub drafter: PathBuf,
    /// Held-out prompts (JSONL).
    #[arg(long)]
    pub prompts: PathBuf,
    #[arg(long, default_value_t = 0)]
    pub offset: usize,
    /// Prompts to decode (0: all).
    #[arg(long, default_value_t = 0)]
    pub limit: usize,
    #[arg(long, default_value_t = 96)]
    pub max_new_tokens: usize,
    /// Also evaluate an untrained drafter of the same shape (seeded).
    #[arg(long)]
    pub baseline: bool,
    /// Write the reports as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Device: "cpu" or a GPU index.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    #[arg(long, default_value_t = 0)]
    pub threads: i32,
    /// Evaluate the fp32 master weights of a training checkpoint instead of
    /// the bf16 served weights.
    #[arg(long)]
    pub master_weights: bool,
}

fn resolve_checkpoint(p: &Path) -> anyhow::Result<PathBuf> {
    if p.join("config.json").is_file() {
        return Ok(p.to_path_buf());
    }
    dflash_models::checkpoint::latest_checkpoint(p)?.with_context(|| {
        format!("{} is neither a drafter checkpoint nor a checkpoint folder with `latest`", p.display())
    })
}

fn print_report(r: &EvalReport, greedy_tps: f64) {
    println!(
        "{:<10} tau {:>5.2}  ({} tokens / {} target verify steps)  {:>6.1} tok/s  ({:.2}x greedy){}",
        r.label,
        r.tau,
        r.tokens,
        r.verify_steps,
        r.tokens_per_s,
        r.tokens_per_s / greedy_tps.max(1e-9),
        match r.lossless {
            Some(true) => "  output == greedy",
            Some(false) => "  OUTPUT DIFFERS FROM GREEDY",
            None => "",
        }
    );
    let cats: Vec<String> = r.per_category.iter().map(|(k, v)| format!("{k} {v:.2}")).collect();
    println!("{:<10} per category: {}", "", cats.join(", "));
    if let (Some(sim), Some(agree)) = (r.simulated_tau, r.step_agreement) {
        println!(
            "{:<10} simulated acceptance over all anchors of the greedy outputs {sim:.2}; \
             verify steps accepting what the training layout predicts: {:.1}%",
            "",
            100.0 * agree
        );
    }
}

pub fn run(a: &EvalArgs) -> anyhow::Result<()> {
    if a.threads > 0 {
        tch::set_num_threads(a.threads);
    }
    let device = match a.device.as_str() {
        "cpu" => Device::Cpu,
        i => dflash_models::cuda::tch_device(Some(i.parse().context("--device: cpu or a GPU index")?))?,
    };
    let kind = if device.is_cuda() { Kind::BFloat16 } else { Kind::Float };
    let ckpt = resolve_checkpoint(&a.drafter)?;
    let config = dflash_models::checkpoint::read_drafter_config(&ckpt)?;
    let tok = ChatTokenizer::from_dir(&a.target)?;
    let target = TargetModel::load(&a.target, device, kind, LoadScope::Full)?;
    let prompts = read_prompts(&a.prompts, &tok, a.offset, a.limit)?;
    let embed = target.embed_tokens().shallow_clone();
    let lm_head = target.lm_head().context("target without an LM head")?.shallow_clone();
    println!(
        "evaluating {} on {} prompts from {} ({} new tokens at most, block {})",
        ckpt.display(),
        prompts.len(),
        a.prompts.display(),
        a.max_new_tokens,
        config.block_size
    );
    let (reference, greedy_tps) = greedy_reference(&target, &prompts, a.max_new_tokens, &tok.stop_ids);
    println!("{:<10} {:>6.1} tok/s", "greedy", greedy_tps);
    let mut reports = Vec::new();
    if a.baseline {
        tch::manual_seed(0);
        let untrained = Drafter::new(config.clone(), device, kind);
        let r = evaluate(
            "untrained",
            &target,
            &untrained,
            &embed,
            &lm_head,
            &prompts,
            a.max_new_tokens,
            &tok.stop_ids,
            Some(&reference),
        );
        print_report(&r, greedy_tps);
        reports.push(r);
    }
    let mut drafter = Drafter::new(config, device, kind);
    if a.master_weights {
        drafter.load_master_weights(&ckpt)?;
    } else {
        drafter.load_weights(&ckpt)?;
    }
    let r = evaluate(
        "trained",
        &target,
        &drafter,
        &embed,
        &lm_head,
        &prompts,
        a.max_new_tokens,
        &tok.stop_ids,
        Some(&reference),
    );
    print_report(&r, greedy_tps);
    reports.push(r);
    if let Some(path) = &a.json {
        let v = serde_json::json!({ "checkpoint": ckpt, "prompts": a.prompts, "greedy_tokens_per_s": greedy_tps, "reports": reports });
        std::fs::write(path, serde_json::to_string_pretty(&v)?)?;
    }
    Ok(())
}

/// Evaluation during training: every `eval.interval_steps` steps (and at
/// the end) the drafter being trained decodes held-out prompts with the
/// full target, and tau goes to the log.
pub struct PeriodicEval {
    target: TargetModel,
    prompts: Vec<EvalPrompt>,
    max_new_tokens: usize,
    stop_ids: Vec<u32>,
    pub every: u64,
}

impl PeriodicEval {
    /// None when `eval.prompts_path` is empty or `eval.interval_steps` is 0.
    pub fn load(c: &dflash_config::RunConfig, device: Device, kind: Kind) -> anyhow::Result<Option<Self>> {
        let e = &c.eval;
        if e.prompts_path.is_empty() || e.interval_steps == 0 {
            return Ok(None);
        }
        let dir = Path::new(&c.model.target_path);
        let tok = ChatTokenizer::from_dir(dir)?;
        let prompts =
            read_prompts(Path::new(&e.prompts_path), &tok, 0, e.max_prompts as usize).context("eval.prompts_path")?;
        let target = TargetModel::load(dir, device, kind, LoadScope::Full)?;
        tracing::info!(
            "periodic evaluation: {} prompts from {}, every {} steps",
            prompts.len(),
            e.prompts_path,
            e.interval_steps
        );
        Ok(Some(Self {
            target,
            prompts,
            max_new_tokens: e.max_new_tokens as usize,
            stop_ids: tok.stop_ids,
            every: e.interval_steps,
        }))
    }

    /// Runs the evaluation and logs tau.
    pub fn run(&self, step: u64, trainer: &dflash_models::Trainer) -> EvalReport {
        let r = evaluate(
            &format!("step {step}"),
            &self.target,
            &trainer.drafter,
            trainer.embed(),
            trainer.lm_head(),
            &self.prompts,
            self.max_new_tokens,
            &self.stop_ids,
            None,
        );
        let cats: Vec<String> = r.per_category.iter().map(|(k, v)| format!("{k} {v:.2}")).collect();
        dflash_telemetry::metrics().acceptance_length.with_label_values(&["eval"]).set(r.tau);
        tracing::info!(
            "eval at step {step}: acceptance length tau {:.3} over {} prompts ({:.1} tok/s; {})",
            r.tau,
            self.prompts.len(),
            r.tokens_per_s,
            cats.join(", ")
        );
        r
    }
}
