//! Validation, once, with errors that name the field.

use crate::{
    ConfigError, DEFAULT_KD_TOP_K, DEFAULT_SELECTOR_LOSS_WEIGHT, DrafterLayerType, FieldError, MAX_KD_TOP_K, Objective,
    RunConfig, default_target_layer_ids,
};

/// What the coordinator learns from the target model to finish the config.
#[derive(Clone, Debug, Default)]
pub struct TargetFacts {
    pub num_layers: u32,
    pub vocab_size: u32,
    /// Width of the target's hidden states (the drafter's width).
    pub hidden_size: u32,
    /// Token ids that must never be the mask token (pad, eos, bos).
    pub reserved_ids: Vec<u32>,
    /// The tokenizer's `<|MASK|>` token, if it has one.
    pub mask_token: Option<u32>,
}

struct Check(Vec<FieldError>);

impl Check {
    fn require(&mut self, ok: bool, field: &str, message: impl FnOnce() -> String) {
        if !ok {
            self.0.push(FieldError { field: field.to_string(), message: message() });
        }
    }
}

impl RunConfig {
    /// Checks every field that can be checked without the target model.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut c = Check(Vec::new());
        self.check_model(&mut c);
        self.check_drafter(&mut c);
        self.check_data(&mut c);
        self.check_training(&mut c);
        self.check_pipeline(&mut c);
        self.check_devices(&mut c);
        self.check_checkpoint(&mut c);
        self.check_eval(&mut c);
        self.check_faults(&mut c);
        if c.0.is_empty() { Ok(()) } else { Err(ConfigError::Invalid(c.0)) }
    }

    /// The checks of `model` and `telemetry`.
    fn check_model(&self, c: &mut Check) {
        let m = &self.model;
        c.require(!m.target_path.is_empty(), "model.target_path", || {
            "is required: a Hugging Face model directory".into()
        });
        let otlp = &self.telemetry.otlp_endpoint;
        c.require(
            otlp.is_empty() || otlp.starts_with("http://") || otlp.starts_with("https://"),
            "telemetry.otlp_endpoint",
            || format!("is \"{otlp}\"; use an http:// or https:// URL of an OTLP/gRPC collector"),
        );
        let ids = &m.target_layer_ids;
        c.require(ids.windows(2).all(|w| w[0] < w[1]), "model.target_layer_ids", || {
            format!("{ids:?} must be strictly increasing")
        });
    }

    /// The checks of `drafter` (and the objective's `gamma`).
    fn check_drafter(&self, c: &mut Check) {
        let d = &self.drafter;
        c.require(d.num_layers >= 1, "drafter.num_layers", || "must be at least 1".into());
        let block = d.block_size();
        c.require(block >= 2, "drafter.block_size", || {
            format!("is {block}; a block needs the anchor and at least one mask")
        });
        match d.dflash2() {
            None => {
                for field in d.dflash2_fields_set() {
                    c.require(false, field, || "is a DFlash2 setting; set drafter.variant = \"dflash2\"".into());
                }
                c.require(self.training.selector_loss_weight.is_none(), "training.selector_loss_weight", || {
                    "weighs DFlash2's selector; set drafter.variant = \"dflash2\"".into()
                });
            }
            Some(v) => {
                c.require((1..=block).contains(&v.conv_kernel_size), "drafter.conv_kernel_size", || {
                    format!(
                        "is {}; must be in [1, drafter.block_size = {block}] (taps never leave their block)",
                        v.conv_kernel_size
                    )
                });
                c.require(v.conv_group_size >= 1, "drafter.conv_group_size", || "must be at least 1".into());
                c.require(v.selector_rank >= 1, "drafter.selector_rank", || "must be at least 1".into());
                c.require(v.selector_top_k >= 1, "drafter.selector_top_k", || "must be at least 1".into());
                if let Some(w) = self.training.selector_loss_weight {
                    c.require(w.is_finite() && w >= 0.0, "training.selector_loss_weight", || {
                        format!("is {w}; must be finite and >= 0")
                    });
                }
            }
        }
        let sliding = d.layer_types.as_ref().is_some_and(|t| t.contains(&DrafterLayerType::SlidingAttention));
        if let Some(types) = &d.layer_types {
            c.require(types.len() == d.num_layers as usize, "drafter.layer_types", || {
                format!("has {} entries; drafter.num_layers is {}: one per layer", types.len(), d.num_layers)
            });
        }
        match d.sliding_window {
            None => c.require(!sliding, "drafter.sliding_window", || {
                "is required: drafter.layer_types names sliding_attention".into()
            }),
            Some(w) => {
                c.require(sliding, "drafter.sliding_window", || {
                    format!("is set ({w}) but no layer in drafter.layer_types is sliding_attention")
                });
                c.require(w >= 1, "drafter.sliding_window", || "must be at least 1".into());
                c.require(w < self.data.max_seq_len, "drafter.sliding_window", || {
                    format!(
                        "is {w}, not below data.max_seq_len ({}): the window would never bound a sequence; \
                         use full_attention",
                        self.data.max_seq_len
                    )
                });
            }
        }
        // Gamma weights the slots of the cross-entropy objectives (data and distilled) only.
        match (self.training.loss, d.effective_gamma()) {
            (Objective::Dpace, _) => {}
            (_, Some(g)) => {
                c.require(g.is_finite() && g > 0.0, "drafter.gamma", || format!("is {g}; must be positive"))
            }
            (_, None) => c.require(false, "drafter.gamma", || format!("has no default for block size {block}; set it")),
        }
    }

    /// The checks of `data`.
    fn check_data(&self, c: &mut Check) {
        let block = self.drafter.block_size();
        let data = &self.data;
        c.require(!data.train_path.is_empty(), "data.train_path", || "is required: a JSONL chat dataset".into());
        c.require(
            data.max_skipped_fraction.is_finite() && (0.0..=1.0).contains(&data.max_skipped_fraction),
            "data.max_skipped_fraction",
            || format!("is {}; must be in [0, 1]", data.max_skipped_fraction),
        );
        c.require(data.cache || data.cache_dir.is_empty(), "data.cache_dir", || {
            format!("is \"{}\" but data.cache = false: set one or the other", data.cache_dir)
        });
        c.require(data.max_seq_len > block, "data.max_seq_len", || {
            format!("is {}; must exceed drafter.block_size ({block})", data.max_seq_len)
        });
    }

    /// The checks of `training`.
    fn check_training(&self, c: &mut Check) {
        let t = &self.training;
        let positive = |x: f64| x.is_finite() && x > 0.0;
        let unit = |x: f64| x.is_finite() && (0.0..1.0).contains(&x);
        c.require(positive(t.lr), "training.lr", || format!("is {}; must be > 0", t.lr));
        c.require(unit(t.warmup_ratio), "training.warmup_ratio", || {
            format!("is {}; must be in [0, 1)", t.warmup_ratio)
        });
        c.require(t.min_lr_ratio.is_finite() && (0.0..=1.0).contains(&t.min_lr_ratio), "training.min_lr_ratio", || {
            format!("is {}; must be in [0, 1]", t.min_lr_ratio)
        });
        c.require(t.weight_decay.is_finite() && t.weight_decay >= 0.0, "training.weight_decay", || {
            format!("is {}; must be >= 0", t.weight_decay)
        });
        c.require(unit(t.adam_beta1), "training.adam_beta1", || format!("is {}; must be in [0, 1)", t.adam_beta1));
        c.require(unit(t.adam_beta2), "training.adam_beta2", || format!("is {}; must be in [0, 1)", t.adam_beta2));
        c.require(positive(t.adam_eps), "training.adam_eps", || format!("is {}; must be > 0", t.adam_eps));
        c.require(t.grad_clip.is_finite() && t.grad_clip >= 0.0, "training.grad_clip", || {
            format!("is {}; must be >= 0 (0 turns clipping off)", t.grad_clip)
        });
        c.require(t.anchors_per_sequence >= 1, "training.anchors_per_sequence", || "must be at least 1".into());
        c.require(
            t.precision == crate::Precision::Bf16 || !self.devices.drafter.is_cpu(),
            "training.precision",
            || {
                format!(
                    "is \"fp8\", but devices.drafter is {}: FP8 matmuls need GPUs of compute capability 8.9 \
                     or newer (Ada, Hopper, Blackwell)",
                    self.devices.drafter
                )
            },
        );
        c.require(t.feature_noise_std.is_finite() && t.feature_noise_std >= 0.0, "training.feature_noise_std", || {
            format!("is {}; must be >= 0", t.feature_noise_std)
        });
        c.require(
            t.max_blocks_per_micro_batch >= t.anchors_per_sequence,
            "training.max_blocks_per_micro_batch",
            || {
                format!(
                    "is {}; must hold one sequence's anchors (training.anchors_per_sequence = {})",
                    t.max_blocks_per_micro_batch, t.anchors_per_sequence
                )
            },
        );
        c.require(t.loss_chunk_blocks >= 1, "training.loss_chunk_blocks", || "must be at least 1".into());
        c.require(t.attention_chunk_blocks >= 1, "training.attention_chunk_blocks", || "must be at least 1".into());
        c.require(t.context_pad_multiple >= 1, "training.context_pad_multiple", || "must be at least 1".into());
        c.require(t.max_bad_batches_in_a_row >= 1, "training.max_bad_batches_in_a_row", || "must be at least 1".into());
        if let Some(k) = t.kd_top_k {
            c.require(t.loss == Objective::Kd, "training.kd_top_k", || {
                format!("is set ({k}) but training.loss is not \"kd\": only distillation reads it")
            });
        }
        if t.loss == Objective::Kd {
            let k = t.kd_top_k.unwrap_or(DEFAULT_KD_TOP_K);
            c.require((1..=MAX_KD_TOP_K).contains(&k), "training.kd_top_k", || {
                format!(
                    "is {k}; must be between 1 and {MAX_KD_TOP_K} (each position ships k ids and log-probabilities)"
                )
            });
            c.require(self.drafter.dflash2().is_none(), "training.loss", || {
                "is \"kd\"; distillation trains the block's own logits, and DFlash2's selector (which learns \
                 from the data tokens) is not combined with it: use \"ce\" or \"dpace\" with drafter.variant = \"dflash2\""
                    .into()
            });
        }
        if let Some(a) = t.dpace_alpha {
            c.require(t.loss == Objective::Dpace, "training.dpace_alpha", || {
                format!("is set ({a}) but training.loss is not \"dpace\": only D-PACE reads it")
            });
            c.require(a.is_finite() && (0.0..=1.0).contains(&a), "training.dpace_alpha", || {
                format!("is {a}; must be in [0, 1]")
            });
        }
        if let (Objective::Dpace, Some(g)) = (t.loss, self.drafter.gamma) {
            c.require(false, "drafter.gamma", || {
                format!(
                    "is set ({g}) but training.loss = \"dpace\" weights the block slots by its own rule; \
                     unset it (it weights slots under \"ce\")"
                )
            });
        }
    }

    /// The checks of `pipeline` and `group`.
    fn check_pipeline(&self, c: &mut Check) {
        let data = &self.data;
        let p = &self.pipeline;
        c.require(p.token_budget >= data.max_seq_len, "pipeline.token_budget", || {
            format!("is {}; must hold one sequence of data.max_seq_len ({})", p.token_budget, data.max_seq_len)
        });
        c.require(p.max_batch_size >= 1, "pipeline.max_batch_size", || "must be at least 1".into());
        c.require(p.prefetch_depth >= 1, "pipeline.prefetch_depth", || "must be at least 1".into());
        c.require(p.hs_queue_depth >= 1, "pipeline.hs_queue_depth", || "must be at least 1".into());
        c.require(p.max_inflight_batches >= 1, "pipeline.max_inflight_batches", || "must be at least 1".into());
        c.require((1..=16).contains(&p.streams_per_target), "pipeline.streams_per_target", || {
            format!("is {}; must be between 1 and 16", p.streams_per_target)
        });
        c.require((64 << 10..=64 << 20).contains(&p.chunk_bytes), "pipeline.chunk_bytes", || {
            format!("is {}; must be between 64 KiB and 64 MiB", p.chunk_bytes)
        });
        let g = &self.group;
        c.require(g.size >= 1, "group.size", || "must be at least 1".into());
        c.require(g.min_size <= g.size, "group.min_size", || {
            format!("is {}; must not exceed group.size ({})", g.min_size, g.size)
        });
        c.require(g.wait_ms >= 1, "group.wait_ms", || "must be at least 1".into());
        c.require(g.collective_timeout_ms >= 1000, "group.collective_timeout_ms", || "must be at least 1000".into());
        // Each member sequences its own batches, one per replica and step:
        // the window is per member and must hold a step's worth.
        let replicas = self.devices.drafter.devices().len() as u32;
        c.require(
            p.reorder_window == 0 || (replicas..=p.hs_queue_depth).contains(&p.reorder_window),
            "pipeline.reorder_window",
            || {
                format!(
                    "is {}; must be 0 (arrival order) or between the drafter's replicas ({replicas}) and \
                     pipeline.hs_queue_depth ({}), so that the batches it holds leave landing buffers free",
                    p.reorder_window, p.hs_queue_depth
                )
            },
        );
        // Ranks step in lockstep on the batches dealt to them, in the plan's
        // order: arrival order would hand a replica a batch out of turn (and
        // a replay as a step of its own).
        c.require(p.reorder_window > 0 || (g.size == 1 && replicas == 1), "pipeline.reorder_window", || {
            format!(
                "is 0 (arrival order), but a drafter group of {} member(s) with {replicas} replica(s) each steps in \
                 lockstep on the plan's order: set it between {replicas} and pipeline.hs_queue_depth ({})",
                g.size, p.hs_queue_depth
            )
        });
        c.require(p.max_target_streams >= p.streams_per_target, "pipeline.max_target_streams", || {
            format!(
                "is {}; must admit at least one target's streams (pipeline.streams_per_target = {})",
                p.max_target_streams, p.streams_per_target
            )
        });
    }

    /// The checks of `devices`.
    fn check_devices(&self, c: &mut Check) {
        let dv = &self.devices;
        let (tg, dr) = (dv.target.cuda_indices(), dv.drafter.cuda_indices());
        let shared: Vec<u32> = tg.iter().copied().filter(|i| dr.contains(i)).collect();
        c.require(shared.is_empty() || dv.share_gpus, "devices.drafter", || {
            format!(
                "names GPU(s) {shared:?} that devices.target names too; set devices.share_gpus = true if one GPU \
                 is to run both roles (or the roles run in separate containers or hosts)"
            )
        });
    }

    /// The checks of `checkpoint`.
    fn check_checkpoint(&self, c: &mut Check) {
        let ck = &self.checkpoint;
        c.require(!ck.dir.is_empty(), "checkpoint.dir", || "is required".into());
        c.require(ck.interval_steps >= 1, "checkpoint.interval_steps", || "must be at least 1".into());
    }

    /// The checks of `eval`.
    fn check_eval(&self, c: &mut Check) {
        let e = &self.eval;
        c.require(e.max_new_tokens >= 1, "eval.max_new_tokens", || "must be at least 1".into());
        c.require(e.sets.is_empty() || !e.prompts_path.is_empty(), "eval.sets", || {
            "needs eval.prompts_path: the primary set is the first one scored".into()
        });
        let mut names = std::collections::BTreeSet::new();
        for (i, s) in e.all_sets().iter().enumerate() {
            let field = if i == 0 { "eval.name".to_string() } else { format!("eval.sets[{}]", i - 1) };
            c.require(!s.name.trim().is_empty(), &field, || "needs a name".into());
            c.require(names.insert(s.name.clone()), &field, || format!("repeats the set name {:?}", s.name));
            c.require(!s.prompts_path.is_empty(), &field, || "needs prompts_path".into());
        }
    }

    /// The checks of `faults`.
    fn check_faults(&self, c: &mut Check) {
        let f = &self.faults;
        c.require(f.heartbeat_interval_ms >= 10, "faults.heartbeat_interval_ms", || "must be at least 10".into());
        c.require(f.instance_timeout_ms > 2 * f.heartbeat_interval_ms, "faults.instance_timeout_ms", || {
            format!(
                "is {}; must exceed two heartbeats (faults.heartbeat_interval_ms = {})",
                f.instance_timeout_ms, f.heartbeat_interval_ms
            )
        });
        for (name, v) in [
            ("faults.lease_timeout_ms", f.lease_timeout_ms),
            ("faults.drafter_absence_timeout_ms", f.drafter_absence_timeout_ms),
            ("faults.coordinator_timeout_ms", f.coordinator_timeout_ms),
            ("faults.rpc_timeout_ms", f.rpc_timeout_ms),
            ("faults.shutdown_grace_ms", f.shutdown_grace_ms),
            ("faults.stream_stall_timeout_ms", f.stream_stall_timeout_ms),
            ("faults.sent_timeout_ms", f.sent_timeout_ms),
            ("faults.supply_stall_alarm_ms", f.supply_stall_alarm_ms),
            ("faults.ack_timeout_ms", f.ack_timeout_ms),
        ] {
            c.require(v >= 1, name, || "must be at least 1".into());
        }
    }

    /// Fills in what depends on the target (layer ids, mask token, gamma)
    /// and checks it against the target. Idempotent.
    pub fn resolve(&mut self, target: &TargetFacts) -> Result<(), ConfigError> {
        let mut c = Check(Vec::new());
        if self.model.target_layer_ids.is_empty() {
            self.model.target_layer_ids = default_target_layer_ids(target.num_layers, self.drafter.num_layers);
        }
        let ids = &self.model.target_layer_ids;
        c.require(ids.iter().all(|&i| i < target.num_layers), "model.target_layer_ids", || {
            format!("{ids:?} names a layer the {}-layer target lacks", target.num_layers)
        });
        if self.drafter.mask_token_id.is_none() {
            self.drafter.mask_token_id = target.mask_token;
        }
        match self.drafter.mask_token_id {
            None => c.require(false, "drafter.mask_token_id", || {
                "is unset and the tokenizer has no <|MASK|> token; pick a reserved, unused token id".into()
            }),
            Some(id) => {
                c.require(id < target.vocab_size, "drafter.mask_token_id", || {
                    format!("{id} is outside the target vocabulary ({})", target.vocab_size)
                });
                c.require(!target.reserved_ids.contains(&id), "drafter.mask_token_id", || {
                    format!("{id} is the pad/eos/bos token; pick a reserved, unused token id")
                });
            }
        }
        if self.drafter.gamma.is_none() && matches!(self.training.loss, Objective::Ce | Objective::Kd) {
            self.drafter.gamma = self.drafter.effective_gamma();
        }
        let d = &mut self.drafter;
        d.block_size = Some(d.block_size());
        if let Some(v) = d.dflash2() {
            c.require(target.hidden_size.is_multiple_of(v.conv_group_size), "drafter.conv_group_size", || {
                format!(
                    "is {}; it must divide the hidden size {} (each group of channels shares one coefficient)",
                    v.conv_group_size, target.hidden_size
                )
            });
            c.require(v.selector_top_k <= target.vocab_size, "drafter.selector_top_k", || {
                format!("is {}; the vocabulary has only {} tokens", v.selector_top_k, target.vocab_size)
            });
            (d.conv_kernel_size, d.conv_group_size, d.selector_rank, d.selector_top_k) =
                (Some(v.conv_kernel_size), Some(v.conv_group_size), Some(v.selector_rank), Some(v.selector_top_k));
            self.training.selector_loss_weight.get_or_insert(DEFAULT_SELECTOR_LOSS_WEIGHT);
        }
        if self.training.loss == Objective::Kd {
            let k = *self.training.kd_top_k.get_or_insert(DEFAULT_KD_TOP_K);
            c.require(k <= target.vocab_size, "training.kd_top_k", || {
                format!("is {k}; the vocabulary has only {} tokens", target.vocab_size)
            });
        }
        if c.0.is_empty() { Ok(()) } else { Err(ConfigError::Invalid(c.0)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DeviceList, DevicesSection, TargetDevices};

    fn valid() -> RunConfig {
        let mut c = RunConfig::default();
        c.model.target_path = "m".into();
        c.data.train_path = "d.jsonl".into();
        c
    }

    #[test]
    fn overlapping_gpu_lists_are_refused_unless_shared_on_purpose() {
        let mut c = valid();
        c.devices.target = TargetDevices::cuda([0, 1]);
        c.devices.drafter = DeviceList::cuda([1, 2]);
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("devices.drafter") && err.contains("[1]") && err.contains("share_gpus"), "{err}");
        c.devices.share_gpus = true;
        c.validate().unwrap();
        c.devices = DevicesSection { target: TargetDevices::cpu(), drafter: DeviceList::cpu(), share_gpus: false };
        c.validate().unwrap();
    }

    #[test]
    fn fp8_matmuls_are_refused_on_a_cpu_drafter_by_name() {
        let mut c = valid();
        c.training.precision = crate::Precision::Fp8;
        c.devices = DevicesSection { target: TargetDevices::cpu(), drafter: DeviceList::cpu(), share_gpus: false };
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("training.precision") && err.contains("devices.drafter is cpu"), "{err}");
        c.devices.drafter = DeviceList::cuda([1]);
        c.validate().unwrap();
        let parsed: crate::TrainingSection = toml::from_str("precision = \"fp8\"").unwrap();
        assert_eq!(parsed.precision, crate::Precision::Fp8);
        let unknown = toml::from_str::<crate::TrainingSection>("precision = \"fp4\"").unwrap_err().to_string();
        assert!(unknown.contains("fp4") && unknown.contains("bf16"), "{unknown}");
    }

    #[test]
    fn the_reorder_window_fits_the_hs_queue_and_feeds_every_replica() {
        let mut c = valid();
        c.devices.drafter = DeviceList::cuda([5, 6, 7]);
        c.pipeline.reorder_window = 9;
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("pipeline.reorder_window") && err.contains("hs_queue_depth (8)"), "{err}");
        c.pipeline.reorder_window = 2;
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("replicas (3)"), "{err}");
        c.pipeline.reorder_window = 0;
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("lockstep") && err.contains("3 replica(s)"), "{err}");
        for ok in [3, 8] {
            c.pipeline.reorder_window = ok;
            c.validate().unwrap();
        }
    }

    #[test]
    fn group_members_may_own_several_devices_and_the_sizes_are_checked() {
        let mut c = valid();
        c.group.size = 2;
        c.devices.drafter = DeviceList::cuda([5, 6]);
        c.validate().unwrap();
        c.devices.drafter = "cpu,cpu".parse().unwrap();
        c.devices.target = TargetDevices::cpu();
        c.validate().unwrap();
        // One target instance of two CPU parts.
        c.devices.target = "cpu,cpu".parse().unwrap();
        c.validate().unwrap();
        c.devices.target = TargetDevices::cpu();
        c.pipeline.reorder_window = 0;
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("pipeline.reorder_window") && err.contains("lockstep"), "{err}");
        c.pipeline.reorder_window = 8;
        c.devices.drafter = DeviceList::cuda([5]);
        c.group.min_size = 3;
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("group.min_size") && err.contains("must not exceed group.size (2)"), "{err}");
    }

    #[test]
    fn the_tokenized_cache_sits_beside_the_data_unless_moved_or_off() {
        let mut c = valid();
        c.data.train_path = "/data/chat.jsonl".into();
        assert_eq!(c.data.tokenized_cache_dir(), Some("/data/.dflash-cache".into()));
        c.data.cache_dir = "/scratch/tok".into();
        assert_eq!(c.data.tokenized_cache_dir(), Some("/scratch/tok".into()));
        c.validate().unwrap();
        // A folder for a cache that is off is a contradiction, refused.
        c.data.cache = false;
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("data.cache_dir") && err.contains("data.cache = false"), "{err}");
        c.data.cache_dir.clear();
        c.validate().unwrap();
        assert_eq!(c.data.tokenized_cache_dir(), None);
    }

    #[test]
    fn defaults_need_only_model_and_data() {
        let err = RunConfig::default().validate().unwrap_err().to_string();
        assert!(err.contains("model.target_path"), "{err}");
        assert!(err.contains("data.train_path"), "{err}");
        valid().validate().unwrap();
    }

    #[test]
    fn every_bad_field_is_named() {
        let mut c = valid();
        c.pipeline.prefetch_depth = 0;
        c.training.lr = f64::NAN;
        c.pipeline.token_budget = 100;
        let err = c.validate().unwrap_err().to_string();
        for field in ["pipeline.prefetch_depth", "training.lr", "pipeline.token_budget"] {
            assert!(err.contains(field), "{field} missing from: {err}");
        }
    }

    #[test]
    fn resolve_fills_layers_mask_and_gamma() {
        let mut c = valid();
        let facts = TargetFacts {
            num_layers: 36,
            vocab_size: 151_936,
            hidden_size: 4096,
            reserved_ids: vec![151_643, 151_645],
            mask_token: Some(151_669),
        };
        c.resolve(&facts).unwrap();
        assert_eq!(c.model.target_layer_ids, vec![1, 9, 17, 25, 33]);
        assert_eq!(c.drafter.mask_token_id, Some(151_669));
        assert_eq!(c.drafter.gamma, Some(7.0));
    }

    #[test]
    fn resolve_rejects_eos_as_mask_and_missing_layers() {
        let mut c = valid();
        c.drafter.mask_token_id = Some(2);
        c.model.target_layer_ids = vec![1, 40];
        let facts = TargetFacts {
            num_layers: 30,
            vocab_size: 49152,
            hidden_size: 576,
            reserved_ids: vec![1, 2],
            mask_token: None,
        };
        let err = c.resolve(&facts).unwrap_err().to_string();
        assert!(err.contains("drafter.mask_token_id"), "{err}");
        assert!(err.contains("model.target_layer_ids"), "{err}");
    }

    #[test]
    fn dflash2_settings_are_refused_without_dflash2_and_checked_against_the_target() {
        let mut c = valid();
        c.drafter.conv_group_size = Some(16);
        c.training.selector_loss_weight = Some(1.0);
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("drafter.conv_group_size") && err.contains("variant = \"dflash2\""), "{err}");
        assert!(err.contains("training.selector_loss_weight"), "{err}");
        c.drafter.variant = crate::DrafterVariant::Dflash2;
        c.validate().unwrap();
        assert_eq!(c.drafter.block_size(), 8, "DFlash2's published block size is the default");
        c.drafter.conv_kernel_size = Some(9);
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("drafter.conv_kernel_size") && err.contains("[1, drafter.block_size = 8]"), "{err}");
        c.drafter.conv_kernel_size = None;
        let mut facts = TargetFacts { num_layers: 30, vocab_size: 100, hidden_size: 584, ..TargetFacts::default() };
        c.drafter.mask_token_id = Some(3);
        c.drafter.selector_top_k = Some(101);
        let err = c.clone().resolve(&facts).unwrap_err().to_string();
        assert!(err.contains("drafter.conv_group_size") && err.contains("hidden size 584"), "{err}");
        assert!(err.contains("drafter.selector_top_k") && err.contains("only 100"), "{err}");
        facts.hidden_size = 576;
        c.drafter.selector_top_k = None;
        c.resolve(&facts).unwrap();
        assert_eq!(
            (c.drafter.block_size, c.drafter.conv_kernel_size, c.drafter.selector_rank),
            (Some(8), Some(2), Some(256))
        );
        assert_eq!(c.training.selector_loss_weight, Some(1.0));
        c.validate().unwrap();
    }

    #[test]
    fn eval_sets_are_named_uniquely_and_need_a_primary() {
        let parsed = crate::from_toml_str(
            "[eval]\nname = \"chat\"\nprompts_path = \"p.jsonl\"\nprompts_offset = 600\n\
             [[eval.sets]]\nname = \"MT-Bench\"\nprompts_path = \"mt.jsonl\"\nper_category = 2\n",
        )
        .unwrap();
        let sets = parsed.eval.all_sets();
        assert_eq!(sets.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(), ["chat", "MT-Bench"]);
        assert_eq!((sets[0].prompts_offset, sets[1].per_category, sets[1].max_prompts), (600, 2, 0));
        let mut c = valid();
        c.eval = parsed.eval.clone();
        c.validate().unwrap();
        c.eval.sets[0].name = "chat".into();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("eval.sets[0]") && err.contains("repeats the set name"), "{err}");
        c.eval.prompts_path.clear();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("eval.sets") && err.contains("eval.prompts_path"), "{err}");
        let bad = crate::from_toml_str("[[eval.sets]]\nname = \"x\"\n").unwrap_err().to_string();
        assert!(bad.contains("prompts_path"), "{bad}");
    }

    #[test]
    fn objectives_are_read_or_refused_with_their_field() {
        let mut c = valid();
        c.training.loss = Objective::Kd;
        c.validate().unwrap();
        c.training.kd_top_k = Some(0);
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("training.kd_top_k") && err.contains("between 1 and 1024"), "{err}");
        c.training.kd_top_k = None;
        c.drafter.variant = crate::DrafterVariant::Dflash2;
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("training.loss") && err.contains("selector"), "{err}");
        c.drafter.variant = crate::DrafterVariant::Dflash;
        c.training.loss = Objective::Ce;
        c.training.kd_top_k = Some(8);
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("training.kd_top_k") && err.contains("only distillation"), "{err}");
        c.training.kd_top_k = None;
        c.training.dpace_alpha = Some(0.5);
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("training.dpace_alpha") && err.contains("only D-PACE"), "{err}");
        c.training.loss = Objective::Dpace;
        c.validate().unwrap();
        c.training.dpace_alpha = Some(1.5);
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("training.dpace_alpha") && err.contains("[0, 1]"), "{err}");
        c.training.dpace_alpha = None;
        c.drafter.gamma = Some(7.0);
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("drafter.gamma") && err.contains("dpace"), "{err}");
        // A block size without a gamma default needs none under D-PACE.
        c.drafter.gamma = None;
        c.drafter.block_size = Some(12);
        c.validate().unwrap();
        let parsed = crate::from_toml_str("[training]\nloss = \"dpace\"\n").unwrap();
        assert_eq!(parsed.training.loss, Objective::Dpace);
        let bad = crate::from_toml_str("[training]\nloss = \"lk\"\n").unwrap_err().to_string();
        assert!(bad.contains("loss") && bad.contains("dpace"), "{bad}");
    }

    #[test]
    fn sliding_layers_are_refused_where_they_do_not_add_up() {
        use DrafterLayerType::{FullAttention, SlidingAttention};
        let mut c = valid();
        c.drafter.num_layers = 2;
        c.drafter.layer_types = Some(vec![SlidingAttention]);
        c.drafter.sliding_window = Some(64);
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("drafter.layer_types") && err.contains("has 1 entries"), "{err}");
        c.drafter.layer_types = Some(vec![SlidingAttention, FullAttention]);
        c.validate().unwrap();
        c.drafter.sliding_window = None;
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("drafter.sliding_window") && err.contains("required"), "{err}");
        c.drafter.sliding_window = Some(c.data.max_seq_len);
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("drafter.sliding_window") && err.contains("data.max_seq_len"), "{err}");
        c.drafter.layer_types = Some(vec![FullAttention, FullAttention]);
        c.drafter.sliding_window = Some(64);
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("no layer") && err.contains("sliding_attention"), "{err}");
        let parsed = crate::from_toml_str(
            "[drafter]\nnum_layers = 2\nlayer_types = [\"sliding_attention\", \"full_attention\"]\nsliding_window = 64\n",
        )
        .unwrap();
        assert_eq!(parsed.drafter.layer_types, Some(vec![SlidingAttention, FullAttention]));
        let bad = crate::from_toml_str("[drafter]\nlayer_types = [\"chunked_attention\"]\n").unwrap_err().to_string();
        assert!(bad.contains("layer_types") && bad.contains("sliding_attention"), "{bad}");
    }
}
