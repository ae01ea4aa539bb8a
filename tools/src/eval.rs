//! `dflash eval`: acceptance length of a trained drafter (and an untrained
//! one beside it) by real speculative decoding on held-out prompts.

use std::path::{Path, PathBuf};

use anyhow::Context;
use dflash_data::ChatTokenizer;
use dflash_models::evaluation::{EvalReport, PromptPick, evaluate, greedy_reference, read_prompts};
use dflash_models::generate::{SpecSettings, first_block_logits};
use dflash_models::{Drafter, LoadScope, TargetModel};
use tch::Kind;

use crate::meter::Meter;

#[derive(clap::Args, Debug)]
pub struct EvalArgs {
    /// Target model directory, or a repo id ORG/NAME[@REVISION] in the
    /// Hugging Face cache.
    #[arg(long, value_parser = dflash_config::hub::resolve_model_dir)]
    pub target: PathBuf,
    /// Drafter checkpoint directory (config.json + model.safetensors), or a
    /// checkpoint root holding a `latest` pointer.
    #[arg(long)]
    pub drafter: PathBuf,
    /// Held-out prompts (JSONL or Parquet conversations; the first user turn
    /// of each is the prompt).
    #[arg(long)]
    pub prompts: PathBuf,
    #[command(flatten)]
    pub slice: crate::regenerate::PromptSlice,
    /// At most this many prompts of one `category` (0: no cap): samples a
    /// file sorted by category, such as MT-Bench, across all of them.
    #[arg(long, default_value_t = 0)]
    pub per_category: usize,
    /// What the prompt set is called in the printout and the JSON.
    #[arg(long, default_value = "held-out")]
    pub set_name: String,
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
    /// Compute dtype: auto (bf16 on a GPU, f32 on the CPU), f32 or bf16. On
    /// a GPU, f32 scores exactly against greedy decoding (bf16 may flip
    /// near-ties between a block verify and a one-token step).
    #[arg(long, default_value = "auto")]
    pub dtype: String,
    /// Evaluate the fp32 master weights of a training checkpoint instead of
    /// the bf16 served weights.
    #[arg(long)]
    pub master_weights: bool,
    /// Also write, for the first N prompts, the trained drafter's logits
    /// of the first block it drafts (`block_logits` in --json): what a
    /// client of the export must reproduce from the same target features.
    #[arg(long, default_value_t = 0, requires = "json")]
    pub block_logits: usize,
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
    if let (Some(ce), Some(acc)) = (r.slot_cross_entropy, r.slot_accuracy) {
        println!(
            "{:<10} drafted slots of those anchors: cross-entropy {ce:.4} nats (no slot weights), accuracy {:.1}%",
            "",
            100.0 * acc
        );
    }
}

pub fn run(a: &EvalArgs) -> anyhow::Result<()> {
    if a.threads > 0 {
        tch::set_num_threads(a.threads);
    }
    let device = crate::cli_args::device(&a.device)?;
    let kind = match (a.dtype.as_str(), device.is_cuda()) {
        ("auto", true) | ("bf16", _) => Kind::BFloat16,
        ("auto", false) | ("f32", _) => Kind::Float,
        (other, _) => anyhow::bail!("--dtype: {other:?} is neither auto, f32 nor bf16"),
    };
    let ckpt = resolve_checkpoint(&a.drafter)?;
    let config = dflash_models::checkpoint::read_drafter_config(&ckpt)?;
    let tok = ChatTokenizer::from_dir(&a.target)?;
    let target = TargetModel::load(&a.target, device, kind, LoadScope::Full)?;
    let pick = PromptPick { offset: a.slice.offset, limit: a.slice.limit, per_category: a.per_category };
    let prompts = read_prompts(&a.prompts, &tok, pick)?;
    let categories: std::collections::BTreeSet<&str> = prompts.iter().map(|p| p.category.as_str()).collect();
    let embed = target.embed_tokens().shallow_clone();
    let lm_head = target.lm_head().context("target without an LM head")?.shallow_clone();
    println!(
        "evaluating {} on {}: {} prompts in {} categories from {} ({} new tokens at most, block {})",
        ckpt.display(),
        a.set_name,
        prompts.len(),
        categories.len(),
        a.prompts.display(),
        a.slice.max_new_tokens,
        config.block_size
    );
    let mut meter = Meter::new("greedy reference", prompts.len() as u64, "prompts");
    let (reference, greedy_tps) =
        greedy_reference(&target, &prompts, a.slice.max_new_tokens, &tok.stop_ids, &mut || meter.add(1, ""));
    meter.finish();
    println!("{:<10} {:>6.1} tok/s", "greedy", greedy_tps);
    let run = |name: &str, drafter: &Drafter| {
        let mut meter = Meter::new(&format!("{name} drafter"), prompts.len() as u64, "prompts");
        let r = evaluate(
            name,
            &target,
            drafter,
            &embed,
            &lm_head,
            &prompts,
            a.slice.max_new_tokens,
            &tok.stop_ids,
            Some(&reference),
            &mut || meter.add(1, ""),
        );
        meter.finish();
        print_report(&r, greedy_tps);
        r
    };
    let mut reports = Vec::new();
    if a.baseline {
        tch::manual_seed(0);
        reports.push(run("untrained", &Drafter::new(config.clone(), device, kind)));
    }
    let mut drafter = Drafter::new(config, device, kind);
    if a.master_weights {
        drafter.load_master_weights(&ckpt)?;
    } else {
        drafter.load_weights(&ckpt)?;
    }
    reports.push(run("trained", &drafter));
    if let Some(path) = &a.json {
        let s = SpecSettings {
            embed: &embed,
            lm_head: &lm_head,
            max_new_tokens: a.slice.max_new_tokens,
            stop_ids: &tok.stop_ids,
        };
        let block_logits: Vec<Vec<Vec<f32>>> = prompts
            .iter()
            .take(a.block_logits)
            .map(|p| Vec::<Vec<f32>>::try_from(first_block_logits(&target, &drafter, &p.ids, &s)))
            .collect::<Result<_, _>>()?;
        let v = serde_json::json!({
            "checkpoint": ckpt,
            "set": a.set_name,
            "prompts": a.prompts,
            "prompt_count": prompts.len(),
            "categories": categories,
            "greedy_tokens_per_s": greedy_tps,
            "max_new_tokens": a.slice.max_new_tokens,
            "stop_ids": tok.stop_ids,
            "reports": reports,
            "block_logits": block_logits,
        });
        std::fs::write(path, serde_json::to_string_pretty(&v)?)?;
    }
    Ok(())
}
