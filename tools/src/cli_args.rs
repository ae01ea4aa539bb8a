//! Command-line values the tools share: a `--device` and a `--shape`.

use anyhow::Context;
use dflash_models::TargetConfig;
use dflash_models::synthetic::{SHAPE_PRESETS, shape_preset};
use tch::Device;

/// `--device`: `cpu` or a GPU index.
pub fn device(arg: &str) -> anyhow::Result<Device> {
    Ok(match arg {
        "cpu" => Device::Cpu,
        i => dflash_models::cuda::tch_device(Some(i.parse().context("--device: cpu or a GPU index")?))?,
    })
}

/// `--shape`: a named target shape with random weights.
pub fn shape(name: &str) -> anyhow::Result<TargetConfig> {
    shape_preset(name).with_context(|| format!("unknown shape {name} (known: {})", SHAPE_PRESETS.join(", ")))
}
