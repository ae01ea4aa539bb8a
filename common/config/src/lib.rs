//! The run config: one struct ([`RunConfig`]), one loader ([`ConfigLoader`]),
//! one validation ([`RunConfig::validate`], [`RunConfig::resolve`]) and one
//! printout ([`RunConfig::startup_banner`]).

mod devices;
mod display;
mod flags;
pub mod hub;
mod loader;
mod run_config;
mod validate;

use std::path::PathBuf;

pub use devices::{Device, DeviceList, TargetDevices, group_name};
pub use flags::ConfigFlags;
pub use loader::{ConfigLoader, ENV_PREFIX, from_toml_str, to_toml_string};
pub use run_config::*;
pub use validate::TargetFacts;

/// One field that failed validation.
#[derive(Clone, Debug, PartialEq)]
pub struct FieldError {
    /// Dotted path, e.g. `pipeline.prefetch_depth`.
    pub field: String,
    pub message: String,
}

/// Why a config could not be loaded or is not valid.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {0} does not exist")]
    MissingFile(PathBuf),
    #[error("cannot read config file {0}: {1}")]
    Read(PathBuf, String),
    #[error("config file {0} is not valid TOML: {1}")]
    Syntax(PathBuf, String),
    #[error("bad flag `{flag}`: {message}")]
    Flag { flag: String, message: String },
    #[error("invalid config: {0}")]
    Load(String),
    #[error("invalid config:{}", .0.iter().map(|e| format!("\n  {}: {}", e.field, e.message)).collect::<String>())]
    Invalid(Vec<FieldError>),
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_device_list_may_be_one_gpu_index_written_as_a_number() {
        let c = ConfigLoader::new().env(false).set("devices.drafter", "1").set("devices.target", "\"0,2\"");
        let c = c.load().unwrap();
        assert_eq!((c.devices.drafter.cuda_indices(), c.devices.target.cuda_indices()), (vec![1], vec![0, 2]));
        let bad = ConfigLoader::new().env(false).set("devices.drafter", "\"gpu1\"").load().unwrap_err();
        assert!(bad.to_string().contains("devices.drafter") && bad.to_string().contains("gpu1"), "{bad}");
    }

    #[test]
    fn precedence_is_defaults_file_env_flags() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        writeln!(f, "[pipeline]\nprefetch_depth = 3\nhs_queue_depth = 5\n[training]\nlr = 1e-3").unwrap();
        let loader = ConfigLoader::new().env(false).file(f.path()).set("pipeline.hs_queue_depth", "7");
        let c = loader.load().unwrap();
        assert_eq!(c.pipeline.prefetch_depth, 3, "file over default");
        assert_eq!(c.pipeline.hs_queue_depth, 7, "flag over file");
        assert_eq!(c.training.lr, 1e-3);
        assert_eq!(c.pipeline.max_inflight_batches, 4, "default kept");
        assert!(loader.describe_sources().starts_with("defaults < file"));
    }

    #[test]
    fn unknown_and_mistyped_fields_are_named() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        writeln!(f, "[pipeline]\nprefetch_dept = 3").unwrap();
        let err = ConfigLoader::new().env(false).file(f.path()).load().unwrap_err().to_string();
        assert!(err.contains("prefetch_dept"), "{err}");

        let err =
            ConfigLoader::new().env(false).set("pipeline.prefetch_depth", "\"many\"").load().unwrap_err().to_string();
        assert!(err.contains("pipeline.prefetch_depth"), "{err}");

        let err = ConfigLoader::new().env(false).set("model.dtype", "\"fp16\"").load().unwrap_err().to_string();
        assert!(err.contains("model.dtype") && err.contains("bf16"), "{err}");
        let c = ConfigLoader::new().env(false).set("model.dtype", "\"bf16\"").load().unwrap();
        assert_eq!(c.model.dtype, ComputeDtype::Bf16);
    }

    #[test]
    fn syntax_errors_name_file_and_line() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        writeln!(f, "[pipeline]\nprefetch_depth = = 3").unwrap();
        let err = ConfigLoader::new().env(false).file(f.path()).load().unwrap_err().to_string();
        assert!(err.contains(&f.path().display().to_string()), "{err}");
        assert!(err.contains("line 2"), "{err}");
    }

    #[test]
    fn missing_file_is_an_error() {
        let err = ConfigLoader::new().file("/nonexistent/x.toml").load().unwrap_err();
        assert!(matches!(err, ConfigError::MissingFile(_)));
    }

    #[test]
    fn flags_parse_booleans_lists_and_devices() {
        let c = ConfigLoader::new()
            .env(false)
            .set_pairs(["pipeline.split_fc_layers=false", "model.target_layer_ids=[1, 3]", "devices.target=cpu"])
            .unwrap()
            .load()
            .unwrap();
        assert!(!c.pipeline.split_fc_layers);
        assert_eq!(c.model.target_layer_ids, vec![1, 3]);
        assert!(c.devices.target.is_cpu());
    }

    #[test]
    fn toml_round_trip_is_lossless() {
        let mut c = RunConfig::default();
        c.drafter.mask_token_id = Some(7);
        c.devices.drafter = DeviceList::cpu();
        let back = from_toml_str(&to_toml_string(&c)).unwrap();
        assert_eq!(back, c);
    }
}
