//! Drafter checkpoints: the served Hugging Face layout (config.json with
//! `dflash_config`, bf16 `model.safetensors`) plus what resuming needs
//! (optimizer state, trainer state). Written to a temporary directory and
//! renamed into place, so a crash never leaves a half checkpoint behind.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::ModelError;
use crate::drafter::DrafterConfig;
use crate::trainer::Trainer;
use crate::weights::write_safetensors;

/// File naming the most recent complete checkpoint directory.
pub const LATEST: &str = "latest";

/// Training progress saved next to the weights.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Optimizer steps taken.
    pub step: u64,
    /// Every batch trained (or skipped as bad) at or before `step`.
    pub batch_ids: Vec<u64>,
    /// The run config (TOML) the checkpoint was trained under.
    pub run_config: String,
    pub run_id: String,
}

/// config.json of a served DFlash drafter.
pub fn hf_config_json(c: &DrafterConfig) -> serde_json::Value {
    serde_json::json!({
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": null,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": false,
        "tie_word_embeddings": false,
        "torch_dtype": "bfloat16",
        "block_size": c.block_size,
        "num_target_layers": c.num_target_layers,
        "dflash_config": {
            "mask_token_id": c.mask_token_id,
            "target_layer_ids": c.target_layer_ids,
        },
    })
}

/// Reads a served drafter's config.json back.
pub fn read_drafter_config(dir: &Path) -> Result<DrafterConfig, ModelError> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| ModelError::Config { path: path.clone(), message: e.to_string() })?;
    let int = |k: &str| {
        v.get(k)
            .and_then(serde_json::Value::as_i64)
            .ok_or_else(|| ModelError::Config { path: path.clone(), message: format!("missing integer field {k}") })
    };
    let float = |k: &str| v.get(k).and_then(serde_json::Value::as_f64);
    let dc = v.get("dflash_config").ok_or_else(|| ModelError::Config {
        path: path.clone(),
        message: "missing dflash_config (not a DFlash drafter?)".into(),
    })?;
    let ids: Vec<i64> = dc
        .get("target_layer_ids")
        .and_then(|x| x.as_array())
        .map(|a| a.iter().filter_map(serde_json::Value::as_i64).collect())
        .unwrap_or_default();
    let hidden = int("hidden_size")?;
    let heads = int("num_attention_heads")?;
    Ok(DrafterConfig {
        hidden_size: hidden,
        intermediate_size: int("intermediate_size")?,
        num_layers: int("num_hidden_layers")?,
        num_heads: heads,
        num_kv_heads: int("num_key_value_heads").unwrap_or(heads),
        head_dim: int("head_dim").unwrap_or(hidden / heads),
        rms_norm_eps: float("rms_norm_eps").unwrap_or(1e-6),
        rope_theta: float("rope_theta").unwrap_or(10_000.0),
        vocab_size: int("vocab_size")?,
        max_position_embeddings: int("max_position_embeddings").unwrap_or(32_768),
        block_size: int("block_size")?,
        mask_token_id: dc.get("mask_token_id").and_then(serde_json::Value::as_i64).ok_or_else(|| {
            ModelError::Config { path: path.clone(), message: "dflash_config lacks mask_token_id".into() }
        })?,
        target_layer_ids: ids,
        num_target_layers: int("num_target_layers").unwrap_or(0),
    })
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<(), ModelError> {
    let mut f = std::fs::File::create(path).map_err(|e| ModelError::io(path, e))?;
    f.write_all(bytes).map_err(|e| ModelError::io(path, e))?;
    f.sync_all().map_err(|e| ModelError::io(path, e))
}

fn sync_dir(dir: &Path) -> Result<(), ModelError> {
    std::fs::File::open(dir).and_then(|f| f.sync_all()).map_err(|e| ModelError::io(dir, e))
}

/// Exports only the served layout (config.json + bf16 model.safetensors).
pub fn export_drafter(dir: &Path, trainer: &Trainer) -> Result<(), ModelError> {
    let c = &trainer.drafter.config;
    let config = serde_json::to_vec_pretty(&hf_config_json(c)).expect("json");
    write_file(&dir.join("config.json"), &config)?;
    let weights: Vec<(String, Tensor)> =
        trainer.drafter.named_parameters().into_iter().map(|(n, t)| (n, t.detach().to_kind(Kind::BFloat16))).collect();
    write_safetensors(&dir.join("model.safetensors"), &weights)?;
    // write_safetensors does not fsync; do it so the rename publishes durable bytes.
    std::fs::File::open(dir.join("model.safetensors"))
        .and_then(|f| f.sync_all())
        .map_err(|e| ModelError::io(&dir.join("model.safetensors"), e))
}

/// Writes `root/step-NNNNNNNN` atomically and points `root/latest` at it;
/// keeps the newest `keep_last` step directories (0: all).
pub fn save_checkpoint(
    root: &Path,
    trainer: &Trainer,
    state: &TrainerState,
    keep_last: usize,
) -> Result<PathBuf, ModelError> {
    std::fs::create_dir_all(root).map_err(|e| ModelError::io(root, e))?;
    let name = format!("step-{:08}", state.step);
    let final_dir = root.join(&name);
    let tmp = root.join(format!(".tmp-{name}-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| ModelError::io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| ModelError::io(&tmp, e))?;
    export_drafter(&tmp, trainer)?;
    let opt_path = tmp.join("optimizer.safetensors");
    write_safetensors(&opt_path, &trainer.opt.state_tensors())?;
    std::fs::File::open(&opt_path).and_then(|f| f.sync_all()).map_err(|e| ModelError::io(&opt_path, e))?;
    write_file(&tmp.join("trainer_state.json"), &serde_json::to_vec(state).expect("json"))?;
    sync_dir(&tmp)?;
    if final_dir.exists() {
        std::fs::remove_dir_all(&final_dir).map_err(|e| ModelError::io(&final_dir, e))?;
    }
    std::fs::rename(&tmp, &final_dir).map_err(|e| ModelError::io(&final_dir, e))?;
    let latest_tmp = root.join(format!(".{LATEST}.tmp"));
    write_file(&latest_tmp, name.as_bytes())?;
    std::fs::rename(&latest_tmp, root.join(LATEST)).map_err(|e| ModelError::io(&root.join(LATEST), e))?;
    sync_dir(root)?;
    if keep_last > 0 {
        prune(root, keep_last)?;
    }
    Ok(final_dir)
}

fn prune(root: &Path, keep_last: usize) -> Result<(), ModelError> {
    let mut steps: Vec<PathBuf> = std::fs::read_dir(root)
        .map_err(|e| ModelError::io(root, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir() && p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("step-")))
        .collect();
    steps.sort();
    let excess = steps.len().saturating_sub(keep_last);
    for old in &steps[..excess] {
        std::fs::remove_dir_all(old).map_err(|e| ModelError::io(old, e))?;
    }
    Ok(())
}

/// The directory `root/latest` points at, if there is a complete one.
pub fn latest_checkpoint(root: &Path) -> Result<Option<PathBuf>, ModelError> {
    let pointer = root.join(LATEST);
    if !pointer.exists() {
        return Ok(None);
    }
    let name = std::fs::read_to_string(&pointer).map_err(|e| ModelError::io(&pointer, e))?;
    let dir = root.join(name.trim());
    if !dir.join("trainer_state.json").is_file() {
        return Err(ModelError::Checkpoint(format!(
            "{} names {} which is not a complete checkpoint",
            pointer.display(),
            dir.display()
        )));
    }
    Ok(Some(dir))
}

/// Restores weights, optimizer and progress from a checkpoint directory.
pub fn restore_checkpoint(dir: &Path, trainer: &mut Trainer) -> Result<TrainerState, ModelError> {
    let state_path = dir.join("trainer_state.json");
    let text = std::fs::read_to_string(&state_path).map_err(|e| ModelError::io(&state_path, e))?;
    let state: TrainerState =
        serde_json::from_str(&text).map_err(|e| ModelError::Checkpoint(format!("{}: {e}", state_path.display())))?;
    let saved = read_drafter_config(dir)?;
    if saved != trainer.drafter.config {
        return Err(ModelError::Checkpoint(format!(
            "{} holds a drafter of another shape or target (saved {:?}, configured {:?})",
            dir.display(),
            saved,
            trainer.drafter.config
        )));
    }
    let opt_path = dir.join("optimizer.safetensors");
    let tensors = Tensor::read_safetensors(&opt_path)
        .map_err(|e| ModelError::Checkpoint(format!("{}: {e}", opt_path.display())))?;
    let map: HashMap<String, Tensor> = tensors.into_iter().collect();
    trainer
        .opt
        .load_state(map, state.step)
        .map_err(|e| ModelError::Checkpoint(format!("{}: {e}", opt_path.display())))?;
    Ok(state)
}
