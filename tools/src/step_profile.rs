//! `bench-step --profile`: one training step taken apart by what its
//! kernels compute, from libtorch's profiler (`kernel_profile`): each
//! class's device time, its share of the step, and the MFU it reaches on
//! its own (its useful FLOPs over its own time); the device's idle time
//! within the step is the host's gaps.

use std::time::Instant;

use dflash_models::kernel_profile::{self, ClassTime, Event, activity};
use dflash_models::{DrafterConfig, StepOutcome};
use serde::Serialize;

/// Useful FLOPs of one step, by what computes them (see `step_flops`).
#[derive(Clone, Copy, Debug, Default)]
pub struct StepFlops {
    /// fc and the layers' projections and MLPs, forward and backward.
    pub layers: f64,
    /// Attention over the visible keys, forward and backward.
    pub attention: f64,
    /// The frozen LM head: forward and input gradient.
    pub lm_head: f64,
}

impl StepFlops {
    pub fn total(&self) -> f64 {
        self.layers + self.attention + self.lm_head
    }
}

impl std::ops::AddAssign for StepFlops {
    fn add_assign(&mut self, o: Self) {
        self.layers += o.layers;
        self.attention += o.attention;
        self.lm_head += o.lm_head;
    }
}

const LAYERS: &str = "layer matmuls";
const HEAD: &str = "LM head matmuls";
const ATTENTION: &str = "attention";
const LOSS: &str = "loss (softmax, CE)";
const OPTIMIZER: &str = "optimizer, clipping";
const NORMS: &str = "norms";
const ELEMENTWISE: &str = "elementwise, RoPE, copies";
const OTHER: &str = "other";

/// The class of a device event, from the op that launched it (name and
/// input shapes: a matmul with a vocabulary-sized dimension is the LM
/// head's) and else the kernel's name.
fn classify(kernel: &Event, op: Option<&Event>, vocab: i64) -> &'static str {
    if kernel.activity == activity::GPU_MEMCPY || kernel.activity == activity::GPU_MEMSET {
        return ELEMENTWISE;
    }
    let o = op.map(|o| o.name.to_ascii_lowercase()).unwrap_or_default();
    let k = kernel.name.to_ascii_lowercase();
    let either = |words: &[&str]| words.iter().any(|w| o.contains(w) || k.contains(w));
    if either(&["adam", "_foreach", "multi_tensor_apply", "clip_grad"]) {
        OPTIMIZER
    } else if either(&["attention", "flash", "fmha", "sdpa"]) {
        ATTENTION
    } else if ["aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm"].contains(&o.as_str())
        || ["gemm", "cutlass", "xmma", "nvjet", "cublas", "gemv"].iter().any(|w| k.contains(w))
    {
        if op.is_some_and(|op| op.has_dim(vocab)) { HEAD } else { LAYERS }
    } else if either(&["softmax", "nll_loss", "cross_entropy", "logsumexp"]) {
        LOSS
    } else if either(&["norm"]) {
        NORMS
    } else if op.is_some() || either(&["elementwise", "reduce", "index", "cat", "copy", "fill"]) {
        ELEMENTWISE
    } else {
        OTHER
    }
}

#[derive(Serialize)]
pub struct ClassRow {
    pub class: String,
    pub kernels: usize,
    pub ms: f64,
    pub share: f64,
    /// The class's useful FLOPs over its own device time, of the matmul peak.
    pub mfu: Option<f64>,
}

/// The device time of one host op (name and input shapes) outside the
/// matmuls and attention: what fusing would save.
#[derive(Serialize)]
pub struct OpRow {
    pub op: String,
    pub kernels: usize,
    pub ms: f64,
}

#[derive(Serialize)]
pub struct StepProfile {
    pub wall_ms: f64,
    pub device_busy_ms: f64,
    pub classes: Vec<ClassRow>,
    /// The largest host ops of the elementwise, norm and loss classes.
    pub top_ops: Vec<OpRow>,
    /// The host ops the device waited on most (its gaps over 20 us).
    pub idle_ops: Vec<OpRow>,
}

/// How many host ops `top_ops` lists.
const TOP_OPS: usize = 15;

/// Runs `step` once under the profiler (`sync` ends it with the device's
/// work done) and sorts its device time by class.
pub fn profile_step(
    cuda: bool,
    config: &DrafterConfig,
    flops: StepFlops,
    peak: f64,
    step: impl FnOnce() -> StepOutcome,
    sync: impl FnOnce(),
) -> anyhow::Result<StepProfile> {
    // The step's own time, inside the profiler: its start and stop take
    // about 0.1 s on a GPU, which is not the step's.
    let ((outcome, took), events) = kernel_profile::record(cuda, || {
        let t0 = Instant::now();
        let o = step();
        sync();
        (o, t0.elapsed())
    })?;
    let wall = took.as_secs_f64();
    if let StepOutcome::Skipped(r) = outcome {
        anyhow::bail!("the profiled step was skipped: {r}");
    }
    let (busy, _) = kernel_profile::device_busy_ns(&events);
    let classes = kernel_profile::device_time_by_class(&events, |k, op| classify(k, op, config.vocab_size));
    let class_flops = |c: &ClassTime| match c.class {
        LAYERS => Some(flops.layers),
        HEAD => Some(flops.lm_head),
        ATTENTION => Some(flops.attention),
        _ => None,
    };
    let mut rows: Vec<ClassRow> = classes
        .iter()
        .map(|c| {
            let secs = c.device_ns as f64 / 1e9;
            ClassRow {
                class: c.class.to_string(),
                kernels: c.events,
                ms: secs * 1e3,
                share: secs / wall,
                mfu: class_flops(c).filter(|_| secs > 0.0).map(|f| f / secs / peak),
            }
        })
        .collect();
    rows.sort_by(|a, b| b.ms.total_cmp(&a.ms));
    let small = |k: &Event, op: Option<&Event>| {
        let class = classify(k, op, config.vocab_size);
        [ELEMENTWISE, NORMS, LOSS, OTHER].contains(&class).then(|| match op {
            Some(o) => format!("{} {}", o.name, o.shapes),
            None => format!("(no op) {}", k.name),
        })
    };
    let top_ops = kernel_profile::device_time_by_key(&events, small, TOP_OPS)
        .into_iter()
        .map(|(op, kernels, ns)| OpRow { op, kernels, ms: ns as f64 / 1e6 })
        .collect();
    let idle_ops = kernel_profile::idle_by_host_op(&events, 20_000, TOP_OPS)
        .into_iter()
        .map(|(op, gaps, ns)| OpRow { op, kernels: gaps, ms: ns as f64 / 1e6 })
        .collect();
    let gaps = (wall - busy as f64 / 1e9).max(0.0);
    rows.push(ClassRow {
        class: "device idle (host gaps)".into(),
        kernels: 0,
        ms: gaps * 1e3,
        share: gaps / wall,
        mfu: None,
    });
    Ok(StepProfile { wall_ms: wall * 1e3, device_busy_ms: busy as f64 / 1e6, classes: rows, top_ops, idle_ops })
}

pub fn print(p: &StepProfile, label: &str) {
    println!(
        "where one profiled step's time goes ({label}; {:.1} ms, device busy {:.1} ms):",
        p.wall_ms, p.device_busy_ms
    );
    println!("  {:<28} {:>8} {:>10} {:>7} {:>12}", "class", "kernels", "ms", "share", "own MFU");
    for r in &p.classes {
        let mfu = r.mfu.map_or_else(String::new, |m| format!("{:.1}%", 100.0 * m));
        println!("  {:<28} {:>8} {:>10.1} {:>6.1}% {:>12}", r.class, r.kernels, r.ms, 100.0 * r.share, mfu);
    }
    println!("  the largest host ops outside the matmuls and attention (op [input shapes]):");
    for o in &p.top_ops {
        let op: String = o.op.chars().take(110).collect();
        println!("  {:>8.1} ms {:>6} kernels  {op}", o.ms, o.kernels);
    }
    println!("  the host ops the device waited on (gaps over 20 us):");
    for o in &p.idle_ops {
        println!("  {:>8.1} ms {:>6} gaps     {}", o.ms, o.kernels, o.op);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(name: &str, shapes: &str, act: u8) -> Event {
        Event {
            name: name.into(),
            shapes: shapes.into(),
            start_ns: 0,
            duration_ns: 1,
            correlation: 0,
            linked_correlation: 0,
            thread: 0,
            activity: act,
            on_device: act != activity::CPU_OP,
        }
    }

    #[test]
    fn kernels_are_classed_by_the_op_that_launched_them() {
        let k = |name| event(name, "", activity::KERNEL);
        let op = |name, shapes| event(name, shapes, activity::CPU_OP);
        let gemm = k("sm90_xmma_gemm_bf16bf16_bf16f32");
        assert_eq!(classify(&gemm, Some(&op("aten::mm", "[512,4096][4096,151936]")), 151936), HEAD);
        assert_eq!(classify(&gemm, Some(&op("aten::mm", "[512,4096][4096,12288]")), 151936), LAYERS);
        assert_eq!(classify(&gemm, None, 151936), LAYERS);
        let flash = k("flash_bwd_kernel");
        assert_eq!(classify(&flash, Some(&op("aten::_flash_attention_backward", "")), 151936), ATTENTION);
        let sm = k("cunn_SoftMaxForward");
        assert_eq!(classify(&sm, Some(&op("aten::_log_softmax", "[512,151936]")), 151936), LOSS);
        let fused = k("multi_tensor_apply_kernel");
        assert_eq!(classify(&fused, Some(&op("aten::_fused_adamw_", "")), 151936), OPTIMIZER);
        let norm = k("vectorized_elementwise_kernel");
        assert_eq!(classify(&norm, Some(&op("aten::_fused_rms_norm", "")), 151936), NORMS);
        assert_eq!(classify(&norm, Some(&op("aten::mul", "")), 151936), ELEMENTWISE);
        assert_eq!(classify(&event("Memcpy DtoH", "", activity::GPU_MEMCPY), None, 151936), ELEMENTWISE);
        assert_eq!(classify(&k("my_kernel"), None, 151936), OTHER);
    }
}
