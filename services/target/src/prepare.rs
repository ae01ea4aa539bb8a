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
    /// Decoder layers of the random target.
    #[arg(long, default_value_t = 6)]
    pub layers: i64,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Writes the synthetic target and dataset unless both already exist.
pub fn synthetic(a: &SyntheticArgs) -> anyhow::Result<()> {
    if a.model_dir.join("model.safetensors").is_file() && a.dataset.is_file() {
        tracing::info!("synthetic target {} and dataset {} exist", a.model_dir.display(), a.dataset.display());
        return Ok(());
    }
    let cfg = dflash_models::synthetic::synthetic_target_config(a.layers);
    dflash_models::synthetic::write_synthetic_target(&a.model_dir, &cfg, a.seed as i64)
        .with_context(|| format!("writing {}", a.model_dir.display()))?;
    if let Some(dir) = a.dataset.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    dflash_data::write_synthetic_dataset(&a.dataset, a.samples, a.seed)?;
    tracing::info!(
        "wrote a random {}-layer Llama-style target to {} and {} conversations to {}",
        a.layers,
        a.model_dir.display(),
        a.samples,
        a.dataset.display()
    );
    Ok(())
}
