//! The run config: every setting of a run, grouped by concern.
//!
//! The coordinator loads it once (see [`crate::ConfigLoader`]), validates it,
//! resolves what depends on the target model (layer ids, gamma, mask token),
//! and hands the result to every target and drafter as TOML when they register.

use serde::{Deserialize, Serialize};

use crate::devices::{DeviceList, TargetDevices};

/// Every setting of one training run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    pub run: RunSection,
    pub model: ModelSection,
    pub drafter: DrafterSection,
    pub group: GroupSection,
    pub data: DataSection,
    pub training: TrainingSection,
    pub pipeline: PipelineSection,
    pub devices: DevicesSection,
    pub checkpoint: CheckpointSection,
    pub eval: EvalSection,
    pub faults: FaultSection,
    pub telemetry: TelemetrySection,
}

/// Identity and length of the run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunSection {
    /// Human-readable run name (also names the ledger and checkpoints).
    pub name: String,
    /// Seed of the data order, anchor sampling, noise and initialisation.
    pub seed: u64,
    /// Passes over the training data.
    pub epochs: u32,
    /// Stop after this many optimizer steps (0: run all epochs).
    pub max_steps: u64,
    /// Log a training line every this many steps.
    pub log_every_steps: u64,
}

impl Default for RunSection {
    fn default() -> Self {
        Self { name: "dflash".into(), seed: 0, epochs: 6, max_steps: 0, log_every_steps: 10 }
    }
}

/// The frozen target model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelSection {
    /// Hugging Face directory (config.json, *.safetensors, tokenizer.json),
    /// or a repo id `ORG/NAME[@REVISION]` in each host's Hugging Face cache
    /// (see [`crate::hub`]).
    pub target_path: String,
    /// Target layers whose residual stream feeds the drafter (HF
    /// `hidden_states[id + 1]`). Empty: spread evenly (see [`default_target_layer_ids`]).
    pub target_layer_ids: Vec<u32>,
    /// Compute dtype of target and drafter; the target ships its features in it.
    pub dtype: ComputeDtype,
}

impl ModelSection {
    /// The target's directory on this host: `target_path` itself, or the
    /// snapshot its repo id names in the host's Hugging Face cache.
    pub fn target_dir(&self) -> Result<std::path::PathBuf, String> {
        crate::hub::resolve_model_dir(&self.target_path).map_err(|e| format!("model.target_path: {e}"))
    }
}

impl Default for ModelSection {
    fn default() -> Self {
        Self { target_path: String::new(), target_layer_ids: Vec::new(), dtype: ComputeDtype::Auto }
    }
}

/// The dtype models compute in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum ComputeDtype {
    /// bf16 on GPUs, f32 on CPUs.
    Auto,
    F32,
    Bf16,
}

impl std::fmt::Display for ComputeDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ComputeDtype::Auto => "auto",
            ComputeDtype::F32 => "f32",
            ComputeDtype::Bf16 => "bf16",
        })
    }
}

/// Shape of the drafter being trained.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DrafterSection {
    /// The drafter architecture: `dflash` (the DFlash drafter, served as
    /// `DFlashDraftModel`) or `dflash2` (DFlash2: an in-block dynamic
    /// convolution around every sublayer and a candidate selector, served as
    /// `DFlash2DraftModel`).
    pub variant: DrafterVariant,
    /// Decoder layers of the drafter.
    pub num_layers: u32,
    /// Tokens per predicted block (anchor + block_size - 1 masks). Unset:
    /// 16 for `dflash`, 8 for `dflash2` (as published); read it through
    /// [`DrafterSection::block_size`].
    pub block_size: Option<u32>,
    /// DFlash2: taps of the in-block convolution (unset: 2, as published).
    pub conv_kernel_size: Option<u32>,
    /// DFlash2: channels sharing one dynamic convolution coefficient; must
    /// divide the hidden size (unset: 16).
    pub conv_group_size: Option<u32>,
    /// DFlash2: rank of the selector's transition codebooks (unset: 256).
    pub selector_rank: Option<u32>,
    /// DFlash2: candidates per slot the selector walks over (unset: 16).
    pub selector_top_k: Option<u32>,
    /// Token id of the MASK slots; must exist in the target's embedding and
    /// must not be pad/eos. Unset: the tokenizer's `<|MASK|>` token.
    pub mask_token_id: Option<u32>,
    /// Loss decay over block slots, exp(-(k-1)/gamma). Unset: 7 for block
    /// 16, 5 for 10, 4 for 8.
    pub gamma: Option<f64>,
    /// Start from the weights of this drafter checkpoint instead of random.
    pub init_from: Option<String>,
    /// Start the decoder layers from the target's top layers (and the final
    /// norm from the target's) instead of random weights.
    pub init_from_target_layers: bool,
    /// Attention of each layer, one entry per layer (unset: every layer
    /// `full_attention`). A `sliding_attention` layer is causal over
    /// [context; block] within `sliding_window` positions, as the `dflash`
    /// package and the serving engines read `layer_types`.
    pub layer_types: Option<Vec<DrafterLayerType>>,
    /// Window of the sliding-attention layers (required with one).
    pub sliding_window: Option<u32>,
}

/// The drafter architecture (`drafter.variant`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum DrafterVariant {
    #[default]
    Dflash,
    Dflash2,
}

/// DFlash2's settings with their defaults filled in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dflash2Settings {
    pub conv_kernel_size: u32,
    pub conv_group_size: u32,
    pub selector_rank: u32,
    pub selector_top_k: u32,
}

/// One drafter layer's attention (`drafter.layer_types`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DrafterLayerType {
    FullAttention,
    SlidingAttention,
}

impl Default for DrafterSection {
    fn default() -> Self {
        Self {
            variant: DrafterVariant::Dflash,
            num_layers: 5,
            block_size: None,
            conv_kernel_size: None,
            conv_group_size: None,
            selector_rank: None,
            selector_top_k: None,
            mask_token_id: None,
            gamma: None,
            init_from: None,
            init_from_target_layers: false,
            layer_types: None,
            sliding_window: None,
        }
    }
}

/// The drafter group: `dflash-drafter serve` instances (on any hosts) that
/// train one drafter together, data parallel, in lockstep. Each member owns
/// the device(s) `devices.drafter` names on its host; the coordinator
/// assigns ranks and a generation, and rank 0 serves the rendezvous.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GroupSection {
    /// Members the group is formed with.
    pub size: u32,
    /// Start with at least this many when `size` have not registered within
    /// `wait_ms` (0: `size`, i.e. wait for all; fewer than this fail the run).
    pub min_size: u32,
    /// How long the coordinator waits for `size` members before it starts
    /// with the ones there (at least `min_size`) or fails the run.
    pub wait_ms: u64,
    /// A collective (gradient all-reduce, agreement, rendezvous) that a
    /// member does not join within this fails, and the group re-forms.
    pub collective_timeout_ms: u64,
}

impl Default for GroupSection {
    fn default() -> Self {
        Self { size: 1, min_size: 0, wait_ms: 120_000, collective_timeout_ms: 60_000 }
    }
}

impl GroupSection {
    /// The fewest members the group may train with.
    pub fn minimum(&self) -> u32 {
        if self.min_size == 0 { self.size } else { self.min_size }
    }
}

/// What to do with a dataset line that cannot be read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MalformedPolicy {
    /// Stop with an error naming file and line.
    Error,
    /// Skip it and count it in the log.
    Skip,
}

/// Training data.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataSection {
    /// JSONL chat dataset (OpenAI `messages` or ShareGPT `conversations`).
    pub train_path: String,
    /// Longer sequences are truncated (and counted in the log).
    pub max_seq_len: u32,
    pub on_malformed: MalformedPolicy,
    /// With `on_malformed = "skip"`: loading fails when more than this
    /// fraction of the lines is skipped (a wrong file, not a few bad lines).
    pub max_skipped_fraction: f64,
    /// Keep the tokenized dataset in a cache file, so that a restarted
    /// target or coordinator reads its samples instead of tokenizing the
    /// dataset again (keyed by the dataset's and tokenizer's bytes).
    pub cache: bool,
    /// Where the cache files go: empty is `.dflash-cache` beside the
    /// dataset (shared by the roles that share the dataset's folder).
    pub cache_dir: String,
}

impl Default for DataSection {
    fn default() -> Self {
        Self {
            train_path: String::new(),
            max_seq_len: 3072,
            on_malformed: MalformedPolicy::Error,
            max_skipped_fraction: 0.5,
            cache: true,
            cache_dir: String::new(),
        }
    }
}

impl DataSection {
    /// The folder of the tokenized-dataset cache, `None` when it is off.
    pub fn tokenized_cache_dir(&self) -> Option<std::path::PathBuf> {
        let train = std::path::Path::new(&self.train_path);
        match (self.cache, self.cache_dir.as_str()) {
            (false, _) => None,
            (true, "") => Some(train.parent().unwrap_or(std::path::Path::new(".")).join(".dflash-cache")),
            (true, dir) => Some(dir.into()),
        }
    }
}

/// Optimizer, schedule and the DFlash training step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainingSection {
    /// Peak learning rate of AdamW.
    pub lr: f64,
    /// Fraction of all steps spent in linear warmup; cosine decay after.
    pub warmup_ratio: f64,
    /// Final learning rate as a fraction of `lr` at the end of the cosine.
    pub min_lr_ratio: f64,
    pub weight_decay: f64,
    pub adam_beta1: f64,
    pub adam_beta2: f64,
    pub adam_eps: f64,
    /// Global gradient-norm clip (0: off).
    pub grad_clip: f64,
    /// Anchors sampled per sequence and step (fewer for short sequences).
    pub anchors_per_sequence: u32,
    /// Std of the uniform noise added to the target features (0: none).
    pub feature_noise_std: f64,
    /// Cap on sequences x anchors in one drafter forward; a batch over it is
    /// split into micro-batches whose gradients are accumulated.
    pub max_blocks_per_micro_batch: u32,
    /// Blocks per chunk of the logits/cross-entropy computation.
    pub loss_chunk_blocks: u32,
    /// Blocks grouped for the block attention. On CUDA (split attention):
    /// blocks sharing one context-prefix flash call. On CPU (chunked mask):
    /// blocks whose queries share one masked attention call, with the
    /// context and their own slots as keys. Exact either way.
    pub attention_chunk_blocks: u32,
    /// Context length of a micro-batch rounded up to a multiple of this
    /// (the padding is masked): fewer distinct attention shapes, so the
    /// attention backend's per-shape plans are reused across batches.
    pub context_pad_multiple: u32,
    /// This many batches in a row with non-finite features or loss fail the run.
    pub max_bad_batches_in_a_row: u32,
    /// Length of the learning-rate schedule in steps (0: every planned
    /// batch; the coordinator fills it in).
    pub total_steps: u64,
    /// The training objective over the drafted slots.
    pub loss: Objective,
    /// D-PACE's smoothing `a` in `q = (1 - a) exp(-CE) + a` (unset: 0.5;
    /// only with `loss = "dpace"`).
    pub dpace_alpha: Option<f64>,
    /// DFlash2: weight of the selector's cross-entropy (over each slot's
    /// top-k candidates, given the true predecessor) added to the block
    /// objective (unset: 1.0; only with `drafter.variant = "dflash2"`).
    pub selector_loss_weight: Option<f64>,
    /// Distillation: how many of the target's most likely next tokens (with
    /// their log-probabilities) each position ships (unset: 32; only with
    /// `loss = "kd"`).
    pub kd_top_k: Option<u32>,
    /// GPU drafters use only libtorch's deterministic kernels (and cuBLAS
    /// with a fixed workspace), so that a run at a fixed world size repeats
    /// bit for bit; an op without a deterministic kernel fails the run,
    /// naming itself. Off by default (BENCHMARKS.md has its cost). CPU runs
    /// repeat bit for bit either way.
    pub deterministic_kernels: bool,
    /// A half-precision drafter (bf16 on GPUs) keeps its residual stream
    /// and its RMSNorms in f32; matmuls and attention stay in bf16. That is
    /// what PyTorch trainers under autocast compute (SpecForge keeps f32
    /// weights, norms and residual stream). Off by default: on SmolLM2 it
    /// reached tau 2.16 on 100 held-out prompts where the bf16 stream
    /// reached 2.20, a rerun's noise apart, for 4% more step time
    /// (BENCHMARKS.md). No effect on a drafter that computes in f32.
    pub f32_residual: bool,
    /// The kind of the drafter's layer matmuls in the training step:
    /// `bf16` (the drafter's own kind) or `fp8` (GPUs of compute capability
    /// 8.9 or newer only; refused on CPU drafters).
    pub precision: Precision,
}

/// The kind of the drafter's layer matmuls (its projections, MLPs and the
/// feature fusion `fc`) in the training step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    /// In the drafter's own kind (bf16 on GPUs).
    #[default]
    Bf16,
    /// e4m3 operands in the forward, e5m2 output gradients in the two
    /// backward matmuls, each tensor scaled by its current absolute maximum
    /// (Transformer Engine's current scaling); products accumulate in f32
    /// and come back in bf16. Master weights, optimizer state, attention,
    /// norms, the frozen LM head and evaluation stay as with `bf16`.
    Fp8,
}

/// The loss over a block's drafted slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Objective {
    /// Cross-entropy on the data tokens, slot k weighted `exp(-(k-1)/gamma)`
    /// (the DFlash recipe).
    #[default]
    Ce,
    /// Cross-entropy weighted per slot by D-PACE: `w_j = sum_{m>=j}
    /// prod_{i<=m} q_i` with `q_i = (1 - a) exp(-CE_i) + a`, detached: the
    /// expected acceptance a correct slot j still contributes to.
    Dpace,
    /// Distillation: the cross-entropy of each slot against the target's
    /// next-token distribution at the same position, restricted to its top
    /// `kd_top_k` tokens (renormalized), which the targets then ship beside
    /// the features; slot weights as for `ce`.
    Kd,
}

/// D-PACE's smoothing when `training.dpace_alpha` is unset.
pub const DEFAULT_DPACE_ALPHA: f64 = 0.5;

/// Distillation's top-k when `training.kd_top_k` is unset.
pub const DEFAULT_KD_TOP_K: u32 = 32;

/// The largest `training.kd_top_k`: at 1,024 a position already ships 8 KiB,
/// as much as a 4,096-wide bf16 layer.
pub const MAX_KD_TOP_K: u32 = 1024;

/// DFlash2's selector loss weight when unset (the peers' default).
pub const DEFAULT_SELECTOR_LOSS_WEIGHT: f64 = 1.0;

impl Default for TrainingSection {
    fn default() -> Self {
        Self {
            lr: 6e-4,
            warmup_ratio: 0.04,
            min_lr_ratio: 0.0,
            weight_decay: 0.0,
            adam_beta1: 0.9,
            adam_beta2: 0.999,
            adam_eps: 1e-8,
            grad_clip: 1.0,
            anchors_per_sequence: 512,
            feature_noise_std: 0.0,
            max_blocks_per_micro_batch: 4096,
            loss_chunk_blocks: 256,
            attention_chunk_blocks: 32,
            context_pad_multiple: 128,
            max_bad_batches_in_a_row: 5,
            total_steps: 0,
            loss: Objective::Ce,
            dpace_alpha: None,
            selector_loss_weight: None,
            kd_top_k: None,
            deterministic_kernels: false,
            f32_residual: false,
            precision: Precision::Bf16,
        }
    }
}

/// Batching and the depths of every queue between the stages.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PipelineSection {
    /// Most tokens in one target batch (sum of packed sequence lengths).
    pub token_budget: u32,
    /// Most sequences in one target batch.
    pub max_batch_size: u32,
    /// Ship per-layer hidden states (SPLIT) and let the drafter concatenate;
    /// false: the target packs [T, k*H] itself (PACKED).
    pub split_fc_layers: bool,
    /// Batches waiting for postprocess per target device.
    pub target_postprocess_depth: u32,
    /// Batches prefetched onto the drafter device ahead of the train step.
    pub prefetch_depth: u32,
    /// Received batches queued on the drafter host.
    pub hs_queue_depth: u32,
    /// Unacknowledged batches one target may have in flight to the drafter.
    pub max_inflight_batches: u32,
    /// Bytes per data chunk on the hidden-state stream.
    pub chunk_bytes: u32,
    /// Parallel streams (connections) from each target to the drafter; the
    /// in-flight limit is split across them.
    pub streams_per_target: u32,
    /// Memory (MiB, per target device, on that device) for the features of
    /// sequences already computed, reused when later epochs revisit them
    /// instead of running the target again (0: off). Pays off when the
    /// target bounds the run and the dataset's features fit.
    pub target_feature_cache_mib: u32,
    /// Hidden-state streams the drafter serves at once (all targets
    /// together); more are refused with RESOURCE_EXHAUSTED.
    pub max_target_streams: u32,
    /// Deterministic order: the drafter trains batches in the plan's order,
    /// holding at most this many that arrive early, and the coordinator
    /// leases no batch further than this past the first untrained one, so
    /// a run is a function of its config, data and seed however often it is
    /// interrupted. 0: train batches as they arrive.
    pub reorder_window: u32,
}

impl Default for PipelineSection {
    fn default() -> Self {
        Self {
            token_budget: 12288,
            max_batch_size: 32,
            split_fc_layers: true,
            target_postprocess_depth: 1,
            prefetch_depth: 2,
            hs_queue_depth: 8,
            max_inflight_batches: 4,
            chunk_bytes: 4 << 20,
            streams_per_target: 2,
            target_feature_cache_mib: 0,
            max_target_streams: 64,
            reorder_window: 8,
        }
    }
}

/// Which devices each role computes on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DevicesSection {
    /// Target instances: one per device group (`"0-3,4"`), each group's
    /// devices splitting its model; one forward loop per instance.
    pub target: TargetDevices,
    /// Data-parallel replicas of the drafter.
    pub drafter: DeviceList,
    /// Allow target and drafter to name the same GPUs: one GPU doing both,
    /// or roles in separate containers or hosts whose GPUs each count
    /// from 0. Off: an overlap is taken for a typo and refused.
    pub share_gpus: bool,
}

impl Default for DevicesSection {
    fn default() -> Self {
        Self { target: TargetDevices::cuda(0..5), drafter: DeviceList::cuda(5..8), share_gpus: false }
    }
}

/// Where and how often the drafter checkpoints.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointSection {
    pub dir: String,
    /// Checkpoint every this many steps (and always at the end).
    pub interval_steps: u64,
    /// Keep this many most recent step checkpoints (0: keep all).
    pub keep_last: u32,
    /// Write checkpoints on a thread of their own while training goes on:
    /// training pauses only to copy the state to host memory (one more copy
    /// of the weights and optimizer state, 14 bytes per parameter, while a
    /// write lasts). Off: training waits for each write.
    pub async_write: bool,
}

impl Default for CheckpointSection {
    fn default() -> Self {
        Self { dir: "runs/checkpoints".into(), interval_steps: 500, keep_last: 3, async_write: true }
    }
}

/// Held-out evaluation by real speculative decoding: during training (the
/// primary prompt set, every `interval_steps`) and after it (`dflash up`
/// scores the primary set and every one of `sets`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvalSection {
    /// What the primary set is called in reports.
    pub name: String,
    /// JSONL or Parquet of held-out prompts (empty: no evaluation).
    pub prompts_path: String,
    /// Skip this many prompts of the file first (e.g. the ones the training
    /// data was made from, when both come from one file).
    pub prompts_offset: u32,
    /// At most this many prompts of one `category` (0: no cap).
    pub per_category: u32,
    /// Evaluate in the drafter every this many steps and at the end (0: never
    /// during training; `dflash up` still evaluates after the run).
    pub interval_steps: u64,
    /// Prompts evaluated each time.
    pub max_prompts: u32,
    /// New tokens generated per prompt (every set).
    pub max_new_tokens: u32,
    /// Further prompt sets `dflash up` scores after training.
    pub sets: Vec<EvalSet>,
}

impl Default for EvalSection {
    fn default() -> Self {
        Self {
            name: "held-out".into(),
            prompts_path: String::new(),
            prompts_offset: 0,
            per_category: 0,
            interval_steps: 0,
            max_prompts: 8,
            max_new_tokens: 64,
            sets: Vec::new(),
        }
    }
}

/// A further prompt set of the final evaluation (`[[eval.sets]]`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvalSet {
    pub name: String,
    pub prompts_path: String,
    #[serde(default)]
    pub prompts_offset: u32,
    #[serde(default)]
    pub per_category: u32,
    /// At most this many prompts (0: all that the other limits leave).
    #[serde(default)]
    pub max_prompts: u32,
}

impl EvalSection {
    /// Every prompt set of the final evaluation, the primary first (none
    /// when `prompts_path` is empty).
    pub fn all_sets(&self) -> Vec<EvalSet> {
        if self.prompts_path.is_empty() {
            return Vec::new();
        }
        let primary = EvalSet {
            name: self.name.clone(),
            prompts_path: self.prompts_path.clone(),
            prompts_offset: self.prompts_offset,
            per_category: self.per_category,
            max_prompts: self.max_prompts,
        };
        std::iter::once(primary).chain(self.sets.iter().cloned()).collect()
    }
}

/// Timeouts and limits that decide when a peer counts as gone.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FaultSection {
    /// How often instances heartbeat to the coordinator.
    pub heartbeat_interval_ms: u64,
    /// An instance silent this long counts as dead.
    pub instance_timeout_ms: u64,
    /// A leased batch not acknowledged within this goes back to pending.
    pub lease_timeout_ms: u64,
    /// The run fails when no drafter is registered for this long.
    pub drafter_absence_timeout_ms: u64,
    /// Roles give up when the coordinator is unreachable for this long.
    pub coordinator_timeout_ms: u64,
    /// Deadline of one control RPC.
    pub rpc_timeout_ms: u64,
    /// How long a role may take to stop after a stop event or signal.
    pub shutdown_grace_ms: u64,
    /// A hidden-state stream in the middle of a batch that brings nothing
    /// for this long is ended, and the batch's landing buffer freed.
    pub stream_stall_timeout_ms: u64,
    /// A batch the drafter acknowledged and has not trained within this
    /// goes back to pending and is sent again. It must exceed the longest a
    /// batch waits in the drafter's queues (queue, prefetch and reorder
    /// window in steps, plus a checkpoint pause).
    pub sent_timeout_ms: u64,
    /// The coordinator raises the `supply_stalled` alarm (metric, status)
    /// when for this long no target produced a feature token and the
    /// drafter trained none while batches are leased or sent.
    pub supply_stall_alarm_ms: u64,
    /// A target whose drafter acknowledges nothing for this long while
    /// batches are outstanding ends the stream and replays them on a new
    /// one. Acknowledgements wait while the drafter's queue is full, so it
    /// must exceed the longest the drafter pauses (a checkpoint, an
    /// evaluation).
    pub ack_timeout_ms: u64,
}

impl Default for FaultSection {
    fn default() -> Self {
        Self {
            heartbeat_interval_ms: 1_000,
            instance_timeout_ms: 10_000,
            lease_timeout_ms: 120_000,
            drafter_absence_timeout_ms: 600_000,
            coordinator_timeout_ms: 60_000,
            rpc_timeout_ms: 10_000,
            shutdown_grace_ms: 20_000,
            stream_stall_timeout_ms: 30_000,
            sent_timeout_ms: 600_000,
            supply_stall_alarm_ms: 180_000,
            ack_timeout_ms: 600_000,
        }
    }
}

/// Where traces go. Metrics endpoints and TLS are per process (flags and
/// environment), because a process needs them before it has this config.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetrySection {
    /// OTLP/gRPC collector for traces (e.g. `http://jaeger:4317`). Empty:
    /// each process uses `OTEL_EXPORTER_OTLP_ENDPOINT` if set, else no traces.
    pub otlp_endpoint: String,
}

impl DrafterSection {
    /// Tokens per block: the configured size or the variant's default.
    pub fn block_size(&self) -> u32 {
        self.block_size.unwrap_or(match self.variant {
            DrafterVariant::Dflash => 16,
            DrafterVariant::Dflash2 => 8,
        })
    }

    /// DFlash2's settings (None for the DFlash drafter).
    pub fn dflash2(&self) -> Option<Dflash2Settings> {
        (self.variant == DrafterVariant::Dflash2).then(|| Dflash2Settings {
            conv_kernel_size: self.conv_kernel_size.unwrap_or(2),
            conv_group_size: self.conv_group_size.unwrap_or(16),
            selector_rank: self.selector_rank.unwrap_or(256),
            selector_top_k: self.selector_top_k.unwrap_or(16),
        })
    }

    /// The DFlash2 settings that are set, by field name.
    pub fn dflash2_fields_set(&self) -> Vec<&'static str> {
        [
            ("drafter.conv_kernel_size", self.conv_kernel_size),
            ("drafter.conv_group_size", self.conv_group_size),
            ("drafter.selector_rank", self.selector_rank),
            ("drafter.selector_top_k", self.selector_top_k),
        ]
        .into_iter()
        .filter_map(|(name, v)| v.map(|_| name))
        .collect()
    }

    /// Gamma of the loss decay: the configured one or the recipe's default
    /// for the block size (None when the block size has no default).
    pub fn effective_gamma(&self) -> Option<f64> {
        self.gamma.or(match self.block_size() {
            16 => Some(7.0),
            10 => Some(5.0),
            8 => Some(4.0),
            _ => None,
        })
    }
}

/// Default capture layers for an `n`-layer target, spread from layer 1 to n-3:
/// `round(1 + i*(n-4)/(k-1))` for i in 0..k; `[n / 2]` when k == 1.
pub fn default_target_layer_ids(num_target_layers: u32, k: u32) -> Vec<u32> {
    if k == 1 {
        return vec![num_target_layers / 2];
    }
    let n = num_target_layers as f64;
    (0..k).map(|i| (1.0 + i as f64 * (n - 4.0) / (k as f64 - 1.0)).round() as u32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_layer_ids_match_the_recipe() {
        assert_eq!(default_target_layer_ids(36, 5), vec![1, 9, 17, 25, 33]);
        assert_eq!(default_target_layer_ids(30, 1), vec![15]);
        assert_eq!(default_target_layer_ids(30, 2), vec![1, 27]);
    }

    #[test]
    fn gamma_defaults_follow_block_size() {
        let mut d = DrafterSection::default();
        assert_eq!(d.effective_gamma(), Some(7.0));
        d.block_size = Some(8);
        assert_eq!(d.effective_gamma(), Some(4.0));
        d.block_size = Some(12);
        assert_eq!(d.effective_gamma(), None);
        d.gamma = Some(3.0);
        assert_eq!(d.effective_gamma(), Some(3.0));
    }
}
