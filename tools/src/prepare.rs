//! Preparing target assets where no model hub is reachable.

use std::path::PathBuf;

use anyhow::Context;

/// Arguments of `prepare-synthetic`.
#[derive(clap::Args, Debug)]
pub struct SyntheticArgs {
    /// Model directory to write (config.json, model.safetensors, tokenizer files).
    #[arg(long)]
    pub model_dir: PathBuf,
    /// JSONL dataset to write.
    #[arg(long)]
    pub dataset: PathBuf,
    /// Conversations in the dataset.
    #[arg(long, default_value_t = 2000)]
    pub samples: usize,
    /// Decoder layers of the random target (for the default shape).
    #[arg(long, default_value_t = 6)]
    pub layers: i64,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Another shape: tiny-qwen3, tiny-qwen2, tiny-moe, smollm2-135m, qwen3-8b, llama3.1-8b, qwen3-30b-a3b.
    #[arg(long)]
    pub shape: Option<String>,
    /// Store bf16 weights (default f32).
    #[arg(long)]
    pub bf16: bool,
    /// Split the weights into this many safetensors shards with an index.
    #[arg(long, default_value_t = 1)]
    pub shards: usize,
    /// Generate the weights on this GPU (large shapes), else on the CPU.
    #[arg(long)]
    pub gpu: Option<u32>,
    /// Tokens per generated conversation: long answers of min..max tokens.
    #[arg(long, num_args = 2, value_names = ["MIN", "MAX"])]
    pub answer_tokens: Option<Vec<usize>>,
}

/// Writes the synthetic target and dataset unless both already exist.
pub fn synthetic(a: &SyntheticArgs) -> anyhow::Result<()> {
    if a.model_dir.join("model.safetensors").is_file() && a.dataset.is_file() {
        tracing::info!("synthetic target {} and dataset {} exist", a.model_dir.display(), a.dataset.display());
        return Ok(());
    }
    let cfg = match &a.shape {
        None => dflash_models::synthetic::synthetic_target_config(a.layers),
        Some(s) => crate::cli_args::shape(s)?,
    };
    let device = dflash_models::cuda::tch_device(a.gpu)?;
    let kind = if a.bf16 { tch::Kind::BFloat16 } else { tch::Kind::Float };
    dflash_models::synthetic::write_random_target_sharded(&a.model_dir, &cfg, a.seed as i64, device, kind, a.shards)
        .with_context(|| format!("writing {}", a.model_dir.display()))?;
    if let Some(dir) = a.dataset.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    match &a.answer_tokens {
        Some(r) => dflash_data::write_long_synthetic_dataset(&a.dataset, a.samples, a.seed, r[0], r[1])?,
        None => dflash_data::write_synthetic_dataset(&a.dataset, a.samples, a.seed)?,
    }
    tracing::info!(
        "wrote a random {:?} target ({} layers, hidden {}) to {} and {} conversations to {}",
        cfg.family,
        cfg.num_layers,
        cfg.hidden_size,
        a.model_dir.display(),
        a.samples,
        a.dataset.display()
    );
    Ok(())
}
