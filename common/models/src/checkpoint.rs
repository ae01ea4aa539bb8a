//! Drafter checkpoints: the served Hugging Face layout (config.json with
//! `dflash_config`, bf16 `model.safetensors`) plus what resuming needs
//! (optimizer state, trainer state), and a `manifest.json` with the size
//! and sha256 of every file. Written to a temporary directory and renamed
//! into place, so a crash never leaves a half checkpoint behind; verified
//! against the manifest before a resume trusts it, so a truncated or
//! altered file is found before it is trained on. The manifest's own hash
//! is the checkpoint's content hash, which the coordinator's ledger
//! records when it commits the checkpoint.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::ModelError;
use crate::drafter::{DrafterConfig, LayerType};
use crate::host_copies::HostCopies;
pub use crate::tensor_file::{FileDigest, digest_file};
use crate::tensor_file::{digest_files, hex, write_file_digested, write_safetensors_digested};
use crate::trainer::Trainer;

/// File naming the most recent complete checkpoint directory (for people
/// and tools; resuming goes by the ledger and the manifests).
pub const LATEST: &str = "latest";

/// The digest of every file of a checkpoint.
pub const MANIFEST: &str = "manifest.json";

/// Files a checkpoint holds, all covered by its manifest.
const FILES: [&str; 4] = ["config.json", "model.safetensors", "optimizer.safetensors", "trainer_state.json"];

/// What a checkpoint's files must be.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub step: u64,
    pub files: BTreeMap<String, FileDigest>,
}

impl Manifest {
    /// sha256 of the manifest: one hash for the whole checkpoint.
    pub fn content_hash(&self) -> String {
        use sha2::Digest;
        hex(&sha2::Sha256::digest(serde_json::to_vec(self).expect("json")))
    }
}

/// A checkpoint on disk, checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checkpoint {
    pub dir: PathBuf,
    pub step: u64,
    pub content_hash: String,
}

impl Checkpoint {
    /// The directory's name (`step-00000100`), as the ledger records it.
    pub fn name(&self) -> String {
        self.dir.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned())
    }
}

/// Checks every file of the checkpoint in `dir` against its manifest and
/// returns the checkpoint with its content hash. A missing manifest, a
/// missing, truncated or altered file is an error naming it.
pub fn verify_checkpoint(dir: &Path) -> Result<Checkpoint, ModelError> {
    let path = dir.join(MANIFEST);
    let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
    let manifest: Manifest =
        serde_json::from_str(&text).map_err(|e| ModelError::Checkpoint(format!("{}: {e}", path.display())))?;
    for f in FILES {
        if !manifest.files.contains_key(f) {
            return Err(ModelError::Checkpoint(format!("{} does not cover {f}", path.display())));
        }
    }
    let found = digest_files(dir, &FILES)?;
    for (name, want) in &manifest.files {
        let got = found.get(name).ok_or_else(|| ModelError::Checkpoint(format!("{name}: not a checkpoint file")))?;
        if got != want {
            return Err(ModelError::Checkpoint(format!(
                "{} is damaged: {} bytes with sha256 {}, the manifest says {} bytes with sha256 {}",
                dir.join(name).display(),
                got.bytes,
                &got.sha256[..12],
                want.bytes,
                &want.sha256[..12]
            )));
        }
    }
    Ok(Checkpoint { dir: dir.to_path_buf(), step: manifest.step, content_hash: manifest.content_hash() })
}

/// The trainer state of a checkpoint (without the tensors).
pub fn read_trainer_state(dir: &Path) -> Result<TrainerState, ModelError> {
    let state_path = dir.join("trainer_state.json");
    let text = std::fs::read_to_string(&state_path).map_err(|e| ModelError::io(&state_path, e))?;
    serde_json::from_str(&text).map_err(|e| ModelError::Checkpoint(format!("{}: {e}", state_path.display())))
}

/// The step directories under `root` (`step-NNNNNNNN`), newest first.
pub fn step_dirs(root: &Path) -> Result<Vec<(u64, PathBuf)>, ModelError> {
    if !root.exists() {
        return Ok(Vec::new());
    }
    let mut out: Vec<(u64, PathBuf)> = std::fs::read_dir(root)
        .map_err(|e| ModelError::io(root, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .filter_map(|p| {
            let step = p.file_name()?.to_str()?.strip_prefix("step-")?.parse().ok()?;
            Some((step, p))
        })
        .collect();
    out.sort_by_key(|e| std::cmp::Reverse(e.0));
    Ok(out)
}

/// Removes what failed or killed checkpoint writes left behind
/// (`.tmp-step-*` directories, a half-written `latest`). Returns them.
pub fn remove_stale_temporaries(root: &Path) -> Result<Vec<PathBuf>, ModelError> {
    if !root.exists() {
        return Ok(Vec::new());
    }
    let mut removed = Vec::new();
    for entry in std::fs::read_dir(root).map_err(|e| ModelError::io(root, e))? {
        let p = entry.map_err(|e| ModelError::io(root, e))?.path();
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
        if name.starts_with(".tmp-step-") || name == format!(".{LATEST}.tmp") {
            if p.is_dir() {
                std::fs::remove_dir_all(&p).map_err(|e| ModelError::io(&p, e))?;
            } else {
                std::fs::remove_file(&p).map_err(|e| ModelError::io(&p, e))?;
            }
            removed.push(p);
        }
    }
    Ok(removed)
}

/// Points `root/latest` at `dir` (after a resume that fell back).
pub fn point_latest(root: &Path, dir: &Path) -> Result<(), ModelError> {
    let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    let tmp = root.join(format!(".{LATEST}.tmp"));
    let moved = write_file(&tmp, name.as_bytes())
        .and_then(|()| std::fs::rename(&tmp, root.join(LATEST)).map_err(|e| ModelError::write(&root.join(LATEST), e)));
    if moved.is_err() {
        discard(&[&tmp]);
    }
    moved?;
    sync_dir(root)
}

/// Moves a checkpoint that cannot be resumed from out of the way (kept
/// for inspection, out of resuming and pruning): `step-N` becomes
/// `unusable-step-N` (with a suffix if that exists). Returns the new path.
pub fn set_aside(dir: &Path) -> Result<PathBuf, ModelError> {
    let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("checkpoint");
    let parent = dir.parent().unwrap_or(Path::new("."));
    let mut target = parent.join(format!("unusable-{name}"));
    let mut n = 1;
    while target.exists() {
        target = parent.join(format!("unusable-{name}.{n}"));
        n += 1;
    }
    std::fs::rename(dir, &target).map_err(|e| ModelError::io(dir, e))?;
    Ok(target)
}

/// Checks that checkpoints can be written under `root`: creates it and
/// writes and removes a probe file (found at startup, not at the first
/// checkpoint).
pub fn check_writable(root: &Path) -> Result<(), ModelError> {
    std::fs::create_dir_all(root).map_err(|e| ModelError::io(root, e))?;
    let probe = root.join(format!(".write-probe-{}", std::process::id()));
    write_file(&probe, b"probe")?;
    std::fs::remove_file(&probe).map_err(|e| ModelError::io(&probe, e))
}

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

/// config.json of a served DFlash drafter. With sliding-attention layers
/// it names them as transformers' Qwen3 config reads them: `layer_types`,
/// `sliding_window` and `use_sliding_window` (without which transformers
/// drops the window).
pub fn hf_config_json(c: &DrafterConfig) -> serde_json::Value {
    let mut v = hf_config_base(c);
    if let Some(w) = c.window() {
        let types: Vec<&str> = (0..c.num_layers as usize).map(|i| c.layer_type(i).name()).collect();
        v["layer_types"] = serde_json::json!(types);
        v["use_sliding_window"] = serde_json::json!(true);
        v["sliding_window"] = serde_json::json!(w);
        v["max_window_layers"] = serde_json::json!(c.num_layers);
    }
    if let Some(d) = &c.dflash2 {
        // As published DFlash2 drafters name it: the architecture, and its
        // shape inside `dflash_config` (where the `dflash` package and the
        // serving engines look first).
        v["architectures"] = serde_json::json!(["DFlash2DraftModel"]);
        let dc = &mut v["dflash_config"];
        dc["block_size"] = serde_json::json!(c.block_size);
        dc["conv_kernel_size"] = serde_json::json!(d.conv_kernel_size);
        dc["conv_group_size"] = serde_json::json!(d.conv_group_size);
        dc["selector_rank"] = serde_json::json!(d.selector_rank);
        dc["selector_top_k"] = serde_json::json!(d.selector_top_k);
    }
    v
}

fn hf_config_base(c: &DrafterConfig) -> serde_json::Value {
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
    let num_layers = int("num_hidden_layers")?;
    let bad = |message: String| ModelError::Config { path: path.clone(), message };
    let layer_types: Vec<LayerType> = match v.get("layer_types") {
        None | Some(serde_json::Value::Null) => Vec::new(),
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .map(|t| {
                t.as_str().and_then(LayerType::parse).ok_or_else(|| {
                    bad(format!("layer_types: {t} is neither \"full_attention\" nor \"sliding_attention\""))
                })
            })
            .collect::<Result<_, _>>()?,
        Some(other) => return Err(bad(format!("layer_types: {other} is not a list"))),
    };
    if !layer_types.is_empty() && layer_types.len() as i64 != num_layers {
        return Err(bad(format!("layer_types has {} entries for {num_layers} layers", layer_types.len())));
    }
    // As transformers reads it: the window only with use_sliding_window.
    let sliding_window = match v.get("use_sliding_window").and_then(serde_json::Value::as_bool) {
        Some(true) => v.get("sliding_window").and_then(serde_json::Value::as_i64),
        _ => None,
    };
    if layer_types.contains(&LayerType::SlidingAttention) && sliding_window.is_none_or(|w| w < 1) {
        return Err(bad(
            "layer_types names sliding_attention but no positive sliding_window with use_sliding_window = true".into(),
        ));
    }
    // The `dflash` package's reading: `dflash_config` first, then the top level.
    let draft_int = |k: &str| dc.get(k).or_else(|| v.get(k)).and_then(serde_json::Value::as_i64);
    let is_dflash2 = v["architectures"].as_array().is_some_and(|a| a.iter().any(|x| x == "DFlash2DraftModel"));
    let dflash2 = if is_dflash2 {
        let need = |k: &str| {
            draft_int(k)
                .filter(|&x| x >= 1)
                .ok_or_else(|| bad(format!("a DFlash2DraftModel needs a positive dflash_config.{k}")))
        };
        let d = crate::dflash2::Dflash2Config {
            conv_kernel_size: need("conv_kernel_size")?,
            conv_group_size: need("conv_group_size")?,
            selector_rank: need("selector_rank")?,
            selector_top_k: need("selector_top_k")?,
        };
        if hidden % d.conv_group_size != 0 {
            return Err(bad(format!(
                "dflash_config.conv_group_size {} does not divide hidden_size {hidden}",
                d.conv_group_size
            )));
        }
        Some(d)
    } else {
        None
    };
    Ok(DrafterConfig {
        hidden_size: hidden,
        intermediate_size: int("intermediate_size")?,
        num_layers,
        num_heads: heads,
        num_kv_heads: int("num_key_value_heads").unwrap_or(heads),
        head_dim: int("head_dim").unwrap_or(hidden / heads),
        rms_norm_eps: float("rms_norm_eps").unwrap_or(1e-6),
        rope_theta: float("rope_theta").unwrap_or(10_000.0),
        vocab_size: int("vocab_size")?,
        max_position_embeddings: int("max_position_embeddings").unwrap_or(32_768),
        block_size: draft_int("block_size").ok_or_else(|| bad("missing integer field block_size".into()))?,
        mask_token_id: dc.get("mask_token_id").and_then(serde_json::Value::as_i64).ok_or_else(|| {
            ModelError::Config { path: path.clone(), message: "dflash_config lacks mask_token_id".into() }
        })?,
        target_layer_ids: ids,
        num_target_layers: int("num_target_layers").unwrap_or(0),
        layer_types,
        sliding_window,
        dflash2,
    })
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<(), ModelError> {
    let mut f = std::fs::File::create(path).map_err(|e| ModelError::write(path, e))?;
    f.write_all(bytes).map_err(|e| ModelError::write(path, e))?;
    f.sync_all().map_err(|e| ModelError::write(path, e))
}

fn sync_file(path: &Path) -> Result<(), ModelError> {
    std::fs::File::open(path).and_then(|f| f.sync_all()).map_err(|e| ModelError::write(path, e))
}

fn sync_dir(dir: &Path) -> Result<(), ModelError> {
    sync_file(dir)
}

/// The model card written into every export: what the drafter is and the
/// loading paths that work. There is no `auto_map` (no remote code ships
/// with it), so transformers' `AutoModel.from_pretrained(dir,
/// trust_remote_code=True)` would build a plain Qwen3 model without `fc`
/// and `hidden_norm`: the card says so and names the paths that load it.
pub fn model_card(c: &DrafterConfig) -> String {
    format!(
        r#"---
library_name: dflash
tags:
  - dflash
  - speculative-decoding
  - draft-model
---

# {title} drafter

A {title} block drafter trained by dflash{extra}: {layers} Qwen3-style layer(s) (hidden size {hidden},
{heads} attention heads, {kv} KV heads), block size {block} (the anchor token and {draft} drafted
tokens), conditioned on the target's hidden states after layers {ids:?} of its
{target_layers}; mask token id {mask}. It shares the target's token embedding and LM head,
which are not in this folder: serve it next to the target it was trained on.

## Loading it

- vLLM: `vllm serve TARGET --speculative-config '{{"method": "dflash", "model": "THIS_DIR", "num_speculative_tokens": {draft}}}'`
- SGLang: `python -m sglang.launch_server --model-path TARGET --speculative-algorithm DFLASH --speculative-draft-model-path THIS_DIR`
- The DFlash authors' package (`pip install dflash`):
  `from dflash.model import {class}, dflash_generate`, then
  `{class}.from_pretrained("THIS_DIR")` and `dflash_generate(drafter, target, input_ids, ...)`
  with the target loaded by transformers (`output_hidden_states` is what feeds it).

`transformers.AutoModel.from_pretrained(THIS_DIR, trust_remote_code=True)` does NOT load it:
this folder ships no remote code (`auto_map`), so transformers would build a plain Qwen3 model
without the drafter's `fc` and `hidden_norm`.
"#,
        title = if c.dflash2.is_some() { "DFlash2" } else { "DFlash" },
        class = if c.dflash2.is_some() { "DFlash2DraftModel" } else { "DFlashDraftModel" },
        extra = match &c.dflash2 {
            Some(d) => format!(
                " (an in-block convolution of {} taps around every sublayer, and a selector walking each \
                 drafted slot's top {} candidates; vLLM and SGLang need a release that serves DFlash2)",
                d.conv_kernel_size, d.selector_top_k
            ),
            None => String::new(),
        },
        layers = c.num_layers,
        hidden = c.hidden_size,
        heads = c.num_heads,
        kv = c.num_kv_heads,
        block = c.block_size,
        draft = c.block_size - 1,
        ids = c.target_layer_ids,
        target_layers = c.num_target_layers,
        mask = c.mask_token_id,
    )
}

/// Exports only the served layout (config.json + bf16 model.safetensors)
/// and its model card (README.md).
pub fn export_drafter(dir: &Path, trainer: &Trainer) -> Result<(), ModelError> {
    let weights: Vec<(String, Tensor)> =
        trainer.drafter.named_parameters().into_iter().map(|(n, t)| (n, t.detach().to_kind(Kind::BFloat16))).collect();
    write_export(dir, &trainer.drafter.config, &weights).map(|_| ())
}

/// The served files (config.json, README.md, bf16 model.safetensors),
/// durable; returns the digests of the ones a manifest covers.
fn write_export(
    dir: &Path,
    c: &DrafterConfig,
    weights: &[(String, Tensor)],
) -> Result<BTreeMap<String, FileDigest>, ModelError> {
    let config = serde_json::to_vec_pretty(&hf_config_json(c)).expect("json");
    let mut files = BTreeMap::new();
    files.insert("config.json".to_string(), write_file_digested(&dir.join("config.json"), &config)?);
    write_file(&dir.join("README.md"), model_card(c).as_bytes())?;
    files.insert("model.safetensors".to_string(), write_safetensors_digested(&dir.join("model.safetensors"), weights)?);
    Ok(files)
}

/// Everything a checkpoint holds, copied off the trainer to host memory:
/// the served bf16 weights, the optimizer's f32 state, the trainer state.
/// Taking it is the only part of a checkpoint that pauses training; writing
/// it ([`CheckpointSnapshot::save`]) can run on another thread meanwhile.
pub struct CheckpointSnapshot {
    config: DrafterConfig,
    buffers: SnapshotBuffers,
    pub state: TrainerState,
}

/// The host memory a snapshot is taken into, handed back after its write
/// ([`CheckpointSnapshot::into_buffers`]) so that the next snapshot reuses
/// it: pinned for a GPU trainer, allocated at the first checkpoint.
#[derive(Default)]
pub struct SnapshotBuffers {
    weights: HostCopies,
    optimizer: HostCopies,
}

impl SnapshotBuffers {
    /// Host memory held.
    pub fn bytes(&self) -> usize {
        self.weights.bytes() + self.optimizer.bytes()
    }
}

impl CheckpointSnapshot {
    /// Copies the trainer's state after its last step into new host buffers.
    pub fn take(trainer: &Trainer, state: TrainerState) -> Result<Self, ModelError> {
        Self::take_into(trainer, state, SnapshotBuffers::default())
    }

    /// Copies the trainer's state after its last step into `buffers` (a
    /// device-to-host copy on a GPU, ordered after that step's kernels on
    /// their stream; it returns once the copy is done).
    pub fn take_into(trainer: &Trainer, state: TrainerState, mut buffers: SnapshotBuffers) -> Result<Self, ModelError> {
        buffers.weights.fill(trainer.drafter.named_parameters(), Some(Kind::BFloat16))?;
        buffers.optimizer.fill(trainer.opt.state_tensors(), None)?;
        Ok(Self { config: trainer.drafter.config.clone(), buffers, state })
    }

    /// Host memory the snapshot holds.
    pub fn bytes(&self) -> usize {
        self.buffers.bytes()
    }

    /// The host tensors held: the weights, then the optimizer's state.
    pub fn tensors(&self) -> impl Iterator<Item = &(String, Tensor)> {
        self.buffers.weights.tensors().iter().chain(self.buffers.optimizer.tensors())
    }

    /// The buffers, for the next snapshot.
    pub fn into_buffers(self) -> SnapshotBuffers {
        self.buffers
    }

    /// Writes the snapshot as [`save_checkpoint`] writes a trainer.
    ///
    /// Everything that takes space is written first, where nothing reads
    /// it: the step's files in `.tmp-step-N-PID` and the new pointer in
    /// `.latest.tmp`. Only then is the step renamed into place and `latest`
    /// moved to it. A write that fails (a full disk) removes what it wrote,
    /// so the space comes back and no step directory exists that the
    /// caller was told failed (a resume would otherwise find it on disk and
    /// commit it); the earlier checkpoints and `latest` stay as they were.
    pub fn save(&self, root: &Path, keep_last: usize) -> Result<Checkpoint, ModelError> {
        std::fs::create_dir_all(root).map_err(|e| ModelError::write(root, e))?;
        let name = format!("step-{:08}", self.state.step);
        let tmp = root.join(format!(".tmp-{name}-{}", std::process::id()));
        let latest_tmp = root.join(format!(".{LATEST}.tmp"));
        let final_dir = root.join(&name);
        let content_hash = match self.write_files(&tmp, &latest_tmp, &name) {
            Ok(hash) => hash,
            Err(e) => {
                discard(&[&tmp, &latest_tmp]);
                return Err(e);
            }
        };
        publish(root, &tmp, &latest_tmp, &final_dir)?;
        if keep_last > 0 {
            prune(root, keep_last)?;
        }
        Ok(Checkpoint { dir: final_dir, step: self.state.step, content_hash })
    }

    /// The step's files, durable, in `tmp`, and `latest_tmp` naming the
    /// step. Returns the content hash.
    fn write_files(&self, tmp: &Path, latest_tmp: &Path, name: &str) -> Result<String, ModelError> {
        if tmp.exists() {
            std::fs::remove_dir_all(tmp).map_err(|e| ModelError::io(tmp, e))?;
        }
        std::fs::create_dir_all(tmp).map_err(|e| ModelError::write(tmp, e))?;
        // Each file is hashed while it is written, not read back.
        let mut files = write_export(tmp, &self.config, self.buffers.weights.tensors())?;
        files.insert(
            "optimizer.safetensors".to_string(),
            write_safetensors_digested(&tmp.join("optimizer.safetensors"), self.buffers.optimizer.tensors())?,
        );
        let state = serde_json::to_vec(&self.state).expect("json");
        files.insert("trainer_state.json".to_string(), write_file_digested(&tmp.join("trainer_state.json"), &state)?);
        debug_assert!(files.keys().map(String::as_str).eq(FILES), "the manifest covers every checkpoint file");
        let manifest = Manifest { step: self.state.step, files };
        write_file(&tmp.join(MANIFEST), &serde_json::to_vec_pretty(&manifest).expect("json"))?;
        sync_dir(tmp)?;
        write_file(latest_tmp, name.as_bytes())?;
        Ok(manifest.content_hash())
    }
}

/// Renames a written checkpoint into place and `latest` to it. Until
/// `latest` moves, a failure undoes the step (its directory is removed);
/// after, the checkpoint is in place and only its directory entry's
/// durability is in doubt (an I/O error, not a full disk: renames and
/// fsync take no space on a filesystem with room for the files).
fn publish(root: &Path, tmp: &Path, latest_tmp: &Path, final_dir: &Path) -> Result<(), ModelError> {
    if final_dir.exists() {
        // Left by a write of the same step that did not finish.
        if let Err(e) = std::fs::remove_dir_all(final_dir) {
            discard(&[tmp, latest_tmp]);
            return Err(ModelError::io(final_dir, e));
        }
    }
    if let Err(e) = std::fs::rename(tmp, final_dir) {
        discard(&[tmp, latest_tmp]);
        return Err(ModelError::write(final_dir, e));
    }
    let latest = root.join(LATEST);
    if let Err(e) = std::fs::rename(latest_tmp, &latest) {
        discard(&[latest_tmp, final_dir]);
        return Err(ModelError::write(&latest, e));
    }
    sync_dir(root)
}

/// Removes what a failed checkpoint write left (files or directories), so
/// that a full disk gets its space back; a removal that fails is logged
/// (the next start removes stale temporaries again).
fn discard(paths: &[&Path]) {
    for p in paths {
        let removed = match std::fs::symlink_metadata(p) {
            Err(_) => continue,
            Ok(m) if m.is_dir() => std::fs::remove_dir_all(p),
            Ok(_) => std::fs::remove_file(p),
        };
        if let Err(e) = removed {
            tracing::warn!("removing {} after a failed checkpoint write: {e}", p.display());
        }
    }
}

/// Writes `root/step-NNNNNNNN` atomically (with its manifest) and points
/// `root/latest` at it; keeps the newest `keep_last` step directories (0:
/// all). A failed write leaves the earlier checkpoints as they were and
/// removes its temporary directory.
pub fn save_checkpoint(
    root: &Path,
    trainer: &Trainer,
    state: &TrainerState,
    keep_last: usize,
) -> Result<Checkpoint, ModelError> {
    CheckpointSnapshot::take(trainer, state.clone())?.save(root, keep_last)
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
/// Call [`verify_checkpoint`] first: this reads the files as they are.
pub fn restore_checkpoint(dir: &Path, trainer: &mut Trainer) -> Result<TrainerState, ModelError> {
    let state = read_trainer_state(dir)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic::synthetic_target_config;

    fn dflash2_config() -> DrafterConfig {
        let mut c = DrafterConfig::for_target(&synthetic_target_config(4), 2, 8, 3, vec![1, 2]);
        c.dflash2 = Some(crate::dflash2::Dflash2Config {
            conv_kernel_size: 2,
            conv_group_size: 16,
            selector_rank: 32,
            selector_top_k: 16,
        });
        c
    }

    #[test]
    fn a_dflash2_config_round_trips_through_its_export() {
        let dir = tempfile::tempdir().unwrap();
        let c = dflash2_config();
        std::fs::write(dir.path().join("config.json"), hf_config_json(&c).to_string()).unwrap();
        assert_eq!(read_drafter_config(dir.path()).unwrap(), c);
        let plain = DrafterConfig { dflash2: None, ..c };
        std::fs::write(dir.path().join("config.json"), hf_config_json(&plain).to_string()).unwrap();
        assert_eq!(read_drafter_config(dir.path()).unwrap(), plain);
    }

    #[test]
    fn a_dflash2_export_missing_a_field_or_with_a_bad_group_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let mut v = hf_config_json(&dflash2_config());
        v["dflash_config"].as_object_mut().unwrap().remove("selector_top_k");
        std::fs::write(dir.path().join("config.json"), v.to_string()).unwrap();
        let e = read_drafter_config(dir.path()).unwrap_err().to_string();
        assert!(e.contains("config.json") && e.contains("dflash_config.selector_top_k"), "{e}");
        let mut v = hf_config_json(&dflash2_config());
        v["dflash_config"]["conv_group_size"] = 7.into();
        std::fs::write(dir.path().join("config.json"), v.to_string()).unwrap();
        let e = read_drafter_config(dir.path()).unwrap_err().to_string();
        assert!(e.contains("conv_group_size 7 does not divide hidden_size 64"), "{e}");
    }
}
