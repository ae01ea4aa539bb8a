//! Turning the loaded config into a runnable plan: resolve what depends on
//! the target, tokenize the dataset, and lay out the batches of every epoch.

use std::path::Path;

use anyhow::Context;
use dflash_config::{MalformedPolicy, RunConfig, TargetFacts};
use dflash_data::{ChatTokenizer, Dataset, LoadOptions, PlannedBatch, plan_epoch};
use serde::Deserialize;

/// The resolved config, the batches, and a fingerprint of what fixes them.
pub struct RunPlan {
    pub config: RunConfig,
    pub batches: Vec<PlannedBatch>,
    pub fingerprint: String,
}

#[derive(serde::Deserialize)]
struct TargetShape {
    num_hidden_layers: u32,
    vocab_size: u32,
    hidden_size: u32,
}

/// Reads the facts about the target that finish the config.
pub fn target_facts(dir: &Path, tok: &ChatTokenizer) -> anyhow::Result<TargetFacts> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).with_context(|| format!("model.target_path: {}", path.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not a model config", path.display()))?;
    // Multimodal configs keep the language model's shape in `text_config`.
    let text = v.get("text_config").filter(|t| t.get("num_hidden_layers").is_some()).unwrap_or(&v);
    let shape = TargetShape::deserialize(text).with_context(|| {
        format!("{}: not a model config (num_hidden_layers, vocab_size, hidden_size)", path.display())
    })?;
    let reserved = [tok.pad_id, tok.bos_id].into_iter().flatten().chain(tok.stop_ids.iter().copied()).collect();
    Ok(TargetFacts {
        num_layers: shape.num_hidden_layers,
        vocab_size: shape.vocab_size,
        hidden_size: shape.hidden_size,
        reserved_ids: reserved,
        mask_token: tok.token_to_id("<|MASK|>"),
    })
}

/// Validates, resolves and plans.
pub fn plan_run(mut config: RunConfig) -> anyhow::Result<RunPlan> {
    config.validate()?;
    let target = config.model.target_dir().map_err(|e| anyhow::anyhow!(e))?;
    let target = target.as_path();
    let tok = ChatTokenizer::from_dir(target).context("model.target_path")?;
    config.resolve(&target_facts(target, &tok)?)?;
    let opts = LoadOptions {
        max_seq_len: config.data.max_seq_len as usize,
        skip_malformed: config.data.on_malformed == MalformedPolicy::Skip,
        max_skipped_fraction: config.data.max_skipped_fraction,
    };
    let cache = config.data.tokenized_cache_dir();
    let data = Dataset::load_cached(Path::new(&config.data.train_path), &tok, &opts, cache.as_deref())
        .context("data.train_path")?;
    tracing::info!("dataset {}: {}", config.data.train_path, data.report);
    let lengths: Vec<(u64, u32)> = data.samples.iter().map(|s| (s.id, s.len() as u32)).collect();
    let p = &config.pipeline;
    let mut batches = Vec::new();
    for epoch in 0..config.run.epochs {
        batches.extend(plan_epoch(&lengths, config.run.seed, epoch, p.token_budget, p.max_batch_size));
    }
    // One batch per replica per optimizer step, across the group's members.
    let replicas = config.devices.drafter.devices().len() as u64 * u64::from(config.group.size);
    if config.run.max_steps > 0 {
        batches.truncate((config.run.max_steps * replicas) as usize);
    }
    if batches.is_empty() {
        anyhow::bail!("the plan has no batches (run.epochs = {})", config.run.epochs);
    }
    if config.training.total_steps == 0 {
        config.training.total_steps = (batches.len() as u64).div_ceil(replicas);
    }
    let fingerprint = format!(
        "seed={} epochs={} budget={} max_batch={} max_steps={} replicas={} data={} samples={} tokens={}",
        config.run.seed,
        config.run.epochs,
        p.token_budget,
        p.max_batch_size,
        config.run.max_steps,
        replicas,
        config.data.train_path,
        data.report.samples,
        data.report.tokens
    );
    tracing::info!(
        "plan: {} batches over {} epoch(s), {} optimizer steps",
        batches.len(),
        config.run.epochs,
        config.training.total_steps
    );
    Ok(RunPlan { config, batches, fingerprint })
}
