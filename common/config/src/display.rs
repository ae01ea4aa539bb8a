//! The startup printout: one grouped, readable block per role.

use std::fmt;

use crate::{DEFAULT_DPACE_ALPHA, MalformedPolicy, Objective, RunConfig};

fn opt<T: fmt::Display>(v: &Option<T>) -> String {
    v.as_ref().map_or_else(|| "unset".to_string(), T::to_string)
}

fn bytes(n: u32) -> String {
    if n.is_multiple_of(1 << 20) { format!("{} MiB", n >> 20) } else { format!("{} KiB", n >> 10) }
}

impl fmt::Display for RunConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sections = [run, target, drafter, data, training, pipeline, checkpoints, evaluation, telemetry, faults];
        sections.iter().try_for_each(|section| section(self, f))
    }
}

/// The run: name, seed, epochs, steps.
fn run(c: &RunConfig, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    let r = &c.run;
    let steps = if r.max_steps == 0 { "all".to_string() } else { r.max_steps.to_string() };
    writeln!(f, "Run")?;
    writeln!(f, "  Name: {}, seed: {}, epochs: {}, max steps: {steps}", r.name, r.seed, r.epochs)?;
    Ok(())
}

/// The target: model, captured layers, devices.
fn target(c: &RunConfig, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    let (m, dev) = (&c.model, &c.devices);
    writeln!(f, "Target")?;
    writeln!(f, "  Model: {} (dtype {})", m.target_path, m.dtype)?;
    writeln!(f, "  Captured layers: {:?}", m.target_layer_ids)?;
    writeln!(f, "  Devices: {}", dev.target)?;
    Ok(())
}

/// The drafter: variant, layers, devices, group.
fn drafter(c: &RunConfig, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    let (d, dev) = (&c.drafter, &c.devices);
    writeln!(f, "Drafter")?;
    let variant = match d.dflash2() {
        None => "DFlash".to_string(),
        Some(v) => format!(
            "DFlash2 (in-block convolution: {} taps, {} channels per group; selector: rank {}, top {})",
            v.conv_kernel_size, v.conv_group_size, v.selector_rank, v.selector_top_k
        ),
    };
    writeln!(f, "  Variant: {variant}")?;
    writeln!(
        f,
        "  Layers: {}, block size: {}, mask token id: {}, gamma: {}",
        d.num_layers,
        d.block_size(),
        opt(&d.mask_token_id),
        opt(&d.effective_gamma())
    )?;
    if let Some(types) = &d.layer_types {
        let names: Vec<&str> = types
            .iter()
            .map(|t| match t {
                crate::DrafterLayerType::FullAttention => "full",
                crate::DrafterLayerType::SlidingAttention => "sliding",
            })
            .collect();
        writeln!(f, "  Layer attention: {} (sliding window {})", names.join(", "), opt(&d.sliding_window))?;
    }
    writeln!(
        f,
        "  Devices: {}, init from: {}{}",
        dev.drafter,
        opt(&d.init_from),
        if d.init_from_target_layers { " (layers from the target's top layers)" } else { "" }
    )?;
    let g = &c.group;
    if g.size > 1 {
        writeln!(
            f,
            "  Group: {} members (at least {} after waiting {} ms), collective timeout {} ms",
            g.size,
            g.minimum(),
            g.wait_ms,
            g.collective_timeout_ms
        )?;
    }
    Ok(())
}

/// The training data.
fn data(c: &RunConfig, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    let data = &c.data;
    writeln!(f, "Data")?;
    let malformed = match data.on_malformed {
        MalformedPolicy::Error => "error",
        MalformedPolicy::Skip => "skip and count",
    };
    writeln!(f, "  Train: {}", data.train_path)?;
    writeln!(f, "  Max sequence length: {}, malformed lines: {malformed}", data.max_seq_len)?;
    match (data.cache, data.cache_dir.as_str()) {
        (false, _) => writeln!(f, "  Tokenized cache: off")?,
        (true, "") => writeln!(f, "  Tokenized cache: .dflash-cache beside the dataset")?,
        (true, dir) => writeln!(f, "  Tokenized cache: {dir}")?,
    }
    Ok(())
}

/// The optimizer, schedule, objective and precision.
fn training(c: &RunConfig, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    let (t, d) = (&c.training, &c.drafter);
    writeln!(f, "Training")?;
    writeln!(
        f,
        "  AdamW lr: {:e}, betas: ({}, {}), eps: {:e}, weight decay: {}, grad clip: {}",
        t.lr, t.adam_beta1, t.adam_beta2, t.adam_eps, t.weight_decay, t.grad_clip
    )?;
    writeln!(f, "  Schedule: warmup {}% then cosine to {}x", t.warmup_ratio * 100.0, t.min_lr_ratio)?;
    let objective = match t.loss {
        Objective::Ce => format!("cross-entropy, slots decayed by gamma {}", opt(&d.effective_gamma())),
        Objective::Dpace => format!(
            "D-PACE (cross-entropy weighted by expected acceptance, alpha {})",
            t.dpace_alpha.unwrap_or(DEFAULT_DPACE_ALPHA)
        ),
        Objective::Kd => format!(
            "distillation (cross-entropy to the target's top-{} next-token distribution), slots decayed by gamma {}",
            t.kd_top_k.unwrap_or(crate::DEFAULT_KD_TOP_K),
            opt(&d.effective_gamma())
        ),
    };
    let selector = match d.dflash2() {
        Some(_) => format!(
            " + {} x the selector's cross-entropy over the top candidates",
            t.selector_loss_weight.unwrap_or(crate::DEFAULT_SELECTOR_LOSS_WEIGHT)
        ),
        None => String::new(),
    };
    writeln!(f, "  Objective: {objective}{selector}")?;
    if t.f32_residual {
        writeln!(
            f,
            "  Precision: residual stream and norms in f32, matmuls in the model's dtype (training.f32_residual)"
        )?;
    }
    if t.precision == crate::Precision::Fp8 {
        writeln!(
            f,
            "  Matmuls: FP8 in the training step (e4m3 forward, e5m2 gradients, per-tensor current scaling; \
             training.precision)"
        )?;
    }
    if t.deterministic_kernels {
        writeln!(f, "  Kernels: deterministic only (training.deterministic_kernels)")?;
    }
    writeln!(
        f,
        "  Anchors per sequence: {}, feature noise std: {}, max blocks per micro-batch: {}",
        t.anchors_per_sequence, t.feature_noise_std, t.max_blocks_per_micro_batch
    )?;
    writeln!(
        f,
        "  Attention: {} blocks per call, context padded to a multiple of {}",
        t.attention_chunk_blocks, t.context_pad_multiple
    )?;
    Ok(())
}

/// The queues and depths between the stages.
fn pipeline(c: &RunConfig, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    let p = &c.pipeline;
    writeln!(f, "Pipeline")?;
    writeln!(f, "  Token budget: {}, max batch size: {}", p.token_budget, p.max_batch_size)?;
    let order = match p.reorder_window {
        0 => "arrival order".to_string(),
        w => format!("plan order (reorder window {w})"),
    };
    writeln!(f, "  Prefetch depth: {}, HS queue: {}, training in {order}", p.prefetch_depth, p.hs_queue_depth)?;
    writeln!(
        f,
        "  Target postprocess depth: {}, split FC layers: {}, target feature cache: {}",
        p.target_postprocess_depth,
        p.split_fc_layers,
        if p.target_feature_cache_mib == 0 { "off".to_string() } else { format!("{} MiB", p.target_feature_cache_mib) }
    )?;
    writeln!(
        f,
        "  In-flight batches per target: {}, streams per target: {} (drafter serves at most {}), chunk size: {}",
        p.max_inflight_batches,
        p.streams_per_target,
        p.max_target_streams,
        bytes(p.chunk_bytes)
    )?;
    Ok(())
}

/// Where and how often checkpoints are written.
fn checkpoints(c: &RunConfig, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    let ck = &c.checkpoint;
    writeln!(f, "Checkpoints")?;
    let keep = if ck.keep_last == 0 { "all".to_string() } else { ck.keep_last.to_string() };
    let write = if ck.async_write { "written while training goes on" } else { "training waits for each write" };
    writeln!(f, "  Dir: {}, every {} steps, keep {keep}; {write}", ck.dir, ck.interval_steps)?;
    Ok(())
}

/// The acceptance-length evaluation.
fn evaluation(c: &RunConfig, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    let e = &c.eval;
    writeln!(f, "Evaluation")?;
    if e.prompts_path.is_empty() {
        writeln!(f, "  Periodic acceptance-length evaluation: off")?;
    } else {
        let every = match e.interval_steps {
            0 => "after training".to_string(),
            n => format!("every {n} steps"),
        };
        writeln!(f, "  {} new tokens per prompt; {every}", e.max_new_tokens)?;
        for s in e.all_sets() {
            let mut pick = vec![match s.max_prompts {
                0 => "all prompts".to_string(),
                n => format!("{n} prompts"),
            }];
            if s.prompts_offset > 0 {
                pick.push(format!("after the first {}", s.prompts_offset));
            }
            if s.per_category > 0 {
                pick.push(format!("at most {} per category", s.per_category));
            }
            writeln!(f, "  {}: {} ({})", s.name, s.prompts_path, pick.join(", "))?;
        }
        if e.interval_steps > 0 && !e.sets.is_empty() {
            writeln!(f, "  (during training only {} is scored; the others after it)", e.name)?;
        }
    }
    Ok(())
}

/// Where traces go.
fn telemetry(c: &RunConfig, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    writeln!(f, "Telemetry")?;
    let otlp = &c.telemetry.otlp_endpoint;
    if otlp.is_empty() {
        writeln!(f, "  Traces: OTEL_EXPORTER_OTLP_ENDPOINT of each process (off when unset)")?;
    } else {
        writeln!(f, "  Traces: OTLP/gRPC to {otlp}")?;
    }
    Ok(())
}

/// The timeouts and alarms.
fn faults(c: &RunConfig, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    let fl = &c.faults;
    writeln!(f, "Faults")?;
    write!(
        f,
        "  Heartbeat: {} ms, instance timeout: {} ms, lease timeout: {} ms, drafter absence timeout: {} ms, \
         stream stall timeout: {} ms, sent timeout: {} ms, supply stall alarm: {} ms, ack timeout: {} ms",
        fl.heartbeat_interval_ms,
        fl.instance_timeout_ms,
        fl.lease_timeout_ms,
        fl.drafter_absence_timeout_ms,
        fl.stream_stall_timeout_ms,
        fl.sent_timeout_ms,
        fl.supply_stall_alarm_ms,
        fl.ack_timeout_ms
    )
}

impl RunConfig {
    /// The block each role logs once at startup.
    pub fn startup_banner(&self, role: &str, run_id: &str) -> String {
        let body: String = self.to_string().lines().map(|l| format!("  {l}\n")).collect();
        format!("{role} effective run config (run {run_id}):\n{body}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn printout_names_the_pipeline_knobs_on_adjacent_lines() {
        let mut c = RunConfig::default();
        c.pipeline.prefetch_depth = 3;
        c.pipeline.hs_queue_depth = 9;
        c.pipeline.target_postprocess_depth = 2;
        c.pipeline.split_fc_layers = false;
        c.pipeline.reorder_window = 4;
        let text = c.startup_banner("drafter", "r1");
        assert!(
            text.contains(
                "Prefetch depth: 3, HS queue: 9, training in plan order (reorder window 4)\n    \
                 Target postprocess depth: 2, split FC layers: false"
            ),
            "{text}"
        );
    }

    #[test]
    fn printout_names_the_objective() {
        let mut c = RunConfig::default();
        assert!(c.to_string().contains("Objective: cross-entropy, slots decayed by gamma 7"), "{c}");
        c.training.loss = Objective::Dpace;
        c.training.dpace_alpha = Some(0.25);
        assert!(
            c.to_string().contains("Objective: D-PACE (cross-entropy weighted by expected acceptance, alpha 0.25)")
        );
    }
}
