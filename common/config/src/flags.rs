//! Command-line flags for the run config, shared by the coordinator and
//! the one-machine launcher (which passes them through).

use std::path::PathBuf;

use crate::{ConfigError, ConfigLoader};

/// The run config's flags: a file, generic `--set` overrides, and named
/// flags for the knobs operators turn most.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct ConfigFlags {
    /// TOML run config (defaults < this file < DFLASH_<SECTION>__<KEY> env < flags).
    #[arg(long, env = "DFLASH_CONFIG")]
    pub config: Option<PathBuf>,
    /// Override any field: `--set section.key=value` (value in TOML syntax).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub set: Vec<String>,
    /// Ship packed [T, k*H] features instead of per-layer ones (pipeline.split_fc_layers = false).
    #[arg(long)]
    pub no_split_fc_layers: bool,
    /// pipeline.target_postprocess_depth (0: postprocess inline, synchronously).
    #[arg(long)]
    pub target_postprocess_depth: Option<u32>,
    /// pipeline.prefetch_depth.
    #[arg(long)]
    pub prefetch_depth: Option<u32>,
    /// pipeline.hs_queue_depth.
    #[arg(long)]
    pub hs_queue_depth: Option<u32>,
    /// pipeline.token_budget.
    #[arg(long)]
    pub token_budget: Option<u32>,
    /// pipeline.max_batch_size.
    #[arg(long)]
    pub max_batch_size: Option<u32>,
    /// run.max_steps.
    #[arg(long)]
    pub max_steps: Option<u64>,
    /// devices.target: "cpu" or GPU groups, one target instance each ("0,1,2,3,4", "0-3,4").
    #[arg(long)]
    pub target_devices: Option<String>,
    /// devices.drafter: "cpu" or GPU indices ("5,6,7").
    #[arg(long)]
    pub drafter_devices: Option<String>,
    /// checkpoint.dir.
    #[arg(long)]
    pub checkpoint_dir: Option<String>,
}

impl ConfigFlags {
    /// The loader these flags describe.
    pub fn loader(&self) -> Result<ConfigLoader, ConfigError> {
        let mut l = ConfigLoader::new();
        if let Some(p) = &self.config {
            l = l.file(p);
        }
        l = l.set_pairs(self.set.iter().map(String::as_str))?;
        if self.no_split_fc_layers {
            l = l.set("pipeline.split_fc_layers", "false");
        }
        let nums = [
            ("pipeline.target_postprocess_depth", self.target_postprocess_depth.map(u64::from)),
            ("pipeline.prefetch_depth", self.prefetch_depth.map(u64::from)),
            ("pipeline.hs_queue_depth", self.hs_queue_depth.map(u64::from)),
            ("pipeline.token_budget", self.token_budget.map(u64::from)),
            ("pipeline.max_batch_size", self.max_batch_size.map(u64::from)),
            ("run.max_steps", self.max_steps),
        ];
        for (key, v) in nums {
            if let Some(v) = v {
                l = l.set(key, v.to_string());
            }
        }
        let strings = [
            ("devices.target", &self.target_devices),
            ("devices.drafter", &self.drafter_devices),
            ("checkpoint.dir", &self.checkpoint_dir),
        ];
        for (key, v) in strings {
            if let Some(v) = v {
                l = l.set(key, format!("{v:?}"));
            }
        }
        Ok(l)
    }

    /// The flags as arguments again (for a launcher to pass on).
    pub fn to_args(&self) -> Vec<String> {
        let mut a = Vec::new();
        if let Some(p) = &self.config {
            a.extend(["--config".into(), p.display().to_string()]);
        }
        for s in &self.set {
            a.extend(["--set".into(), s.clone()]);
        }
        if self.no_split_fc_layers {
            a.push("--no-split-fc-layers".into());
        }
        let opts: Vec<(&str, Option<String>)> = vec![
            ("--target-postprocess-depth", self.target_postprocess_depth.map(|v| v.to_string())),
            ("--prefetch-depth", self.prefetch_depth.map(|v| v.to_string())),
            ("--hs-queue-depth", self.hs_queue_depth.map(|v| v.to_string())),
            ("--token-budget", self.token_budget.map(|v| v.to_string())),
            ("--max-batch-size", self.max_batch_size.map(|v| v.to_string())),
            ("--max-steps", self.max_steps.map(|v| v.to_string())),
            ("--target-devices", self.target_devices.clone()),
            ("--drafter-devices", self.drafter_devices.clone()),
            ("--checkpoint-dir", self.checkpoint_dir.clone()),
        ];
        for (flag, v) in opts {
            if let Some(v) = v {
                a.extend([flag.to_string(), v]);
            }
        }
        a
    }
}
