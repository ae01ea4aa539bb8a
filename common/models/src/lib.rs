//! Model code on libtorch (tch): the frozen targets (a zoo of families in
//! `zoo/`, sharing the layers in `layers.rs`, `rope.rs`, `moe.rs`,
//! `gated_deltanet.rs` + `delta_rule.rs` and `decoder.rs`) with layer capture, the DFlash drafter and its training
//! step, AdamW, checkpoints in the served layout, and CUDA loading.

pub mod acceptance;
pub mod attention;
pub mod block_conv_cuda;
pub mod blocks;
pub mod checkpoint;
pub mod collective;
pub mod cuda;
pub mod decoder;
pub mod delta_rule;
pub mod delta_rule_cuda;
pub mod dflash2;
pub mod distill;
pub mod dp;
pub mod drafter;
pub mod evaluation;
pub mod features;
pub mod fp8;
pub mod fused_cuda;
pub mod fused_layers;
pub mod gated_deltanet;
pub mod gather_sum_cuda;
pub mod generate;
pub mod gloo;
pub mod gpu;
pub mod group;
pub mod hf_config;
pub mod host_copies;
pub mod kernel_profile;
pub mod kv_cache;
pub mod latent_attention;
pub mod layers;
pub mod moe;
pub(crate) mod nvrtc;
pub mod objective;
pub mod optim;
pub mod perf;
pub mod placement;
pub mod quant;
pub mod rope;
pub mod softmax_cuda;
pub mod split_attention;
pub mod synthetic;
pub mod target;
pub mod target_config;
pub mod tensor_file;
pub mod top_k_cuda;
pub mod trainer;
pub mod weights;
pub mod zoo;

use std::path::{Path, PathBuf};

pub use distill::TopK;
pub use drafter::{BlockAttention, Drafter, DrafterConfig, DrafterInput, LayerType};
pub use kv_cache::KvCache;
pub use target::{Inspection, LoadScope, TargetModel, load_embeddings};
pub use target_config::{Family, LayerKind, MoeConfig, TargetConfig};
pub use trainer::{DeviceBatch, Objective, StepMetrics, StepOutcome, TrainSettings, Trainer};

/// Why a model could not be loaded, run or saved. Variants name the file.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{}: {message}", path.display())]
    Io { path: PathBuf, message: String },
    /// A write that found its disk full (or its quota spent): freeing
    /// space there is what helps, not a retry alone.
    #[error("{}: {message}", path.display())]
    NoSpace { path: PathBuf, message: String },
    #[error("{}: {message}", path.display())]
    Config { path: PathBuf, message: String },
    #[error("{}: {message}", path.display())]
    Weights { path: PathBuf, message: String },
    #[error("{}: missing tensor {name}", dir.display())]
    MissingTensor { dir: PathBuf, name: String },
    #[error("device: {0}")]
    Device(String),
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
}

impl ModelError {
    pub fn io(path: &Path, e: impl std::fmt::Display) -> Self {
        ModelError::Io { path: path.to_path_buf(), message: e.to_string() }
    }

    /// A failed write of `path`: [`ModelError::NoSpace`] when the disk is
    /// full (ENOSPC) or the quota spent (EDQUOT), else [`ModelError::Io`].
    pub fn write(path: &Path, e: std::io::Error) -> Self {
        use std::io::ErrorKind::{QuotaExceeded, StorageFull};
        match e.kind() {
            StorageFull | QuotaExceeded => ModelError::NoSpace { path: path.to_path_buf(), message: e.to_string() },
            _ => Self::io(path, e),
        }
    }

    /// Whether this is a write that found no space.
    pub fn is_no_space(&self) -> bool {
        matches!(self, ModelError::NoSpace { .. })
    }
}
