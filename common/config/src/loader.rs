//! The one loader: defaults < TOML file < environment < CLI flags.
//!
//! Environment variables are `DFLASH_<SECTION>__<KEY>` (double underscore
//! between section and key, e.g. `DFLASH_PIPELINE__PREFETCH_DEPTH=4`); other
//! `DFLASH_*` variables (addresses, log level) are not config and are ignored.
//! Flags are `section.key=value` pairs whose value is read as TOML
//! (`4`, `true`, `"text"`, `[1, 2]`), falling back to a plain string.

use std::path::PathBuf;

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};

use crate::{ConfigError, RunConfig};

/// Prefix of config environment variables.
pub const ENV_PREFIX: &str = "DFLASH_";

/// Builds a [`RunConfig`] from its layered sources.
#[derive(Default)]
pub struct ConfigLoader {
    file: Option<PathBuf>,
    use_env: bool,
    overrides: Vec<(String, String)>,
}

impl ConfigLoader {
    pub fn new() -> Self {
        Self { file: None, use_env: true, overrides: Vec::new() }
    }

    /// Reads this TOML file over the defaults. A missing file is an error.
    pub fn file(mut self, path: impl Into<PathBuf>) -> Self {
        self.file = Some(path.into());
        self
    }

    /// Whether `DFLASH_<SECTION>__<KEY>` variables apply (default true).
    pub fn env(mut self, on: bool) -> Self {
        self.use_env = on;
        self
    }

    /// One `section.key = value` flag; later flags win.
    pub fn set(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.overrides.push((key.into(), value.into()));
        self
    }

    /// `section.key=value` strings, as given to `--set`.
    pub fn set_pairs<'a>(mut self, pairs: impl IntoIterator<Item = &'a str>) -> Result<Self, ConfigError> {
        for pair in pairs {
            let (k, v) = pair.split_once('=').ok_or_else(|| ConfigError::Flag {
                flag: pair.to_string(),
                message: "expected section.key=value".into(),
            })?;
            self = self.set(k.trim(), v.trim());
        }
        Ok(self)
    }

    /// Loads and checks the field types; call [`RunConfig::validate`] next.
    pub fn load(&self) -> Result<RunConfig, ConfigError> {
        let mut fig = Figment::from(Serialized::defaults(RunConfig::default()));
        if let Some(path) = &self.file {
            if !path.is_file() {
                return Err(ConfigError::MissingFile(path.clone()));
            }
            // Parse once by hand so a syntax error names file, line and column.
            let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read(path.clone(), e.to_string()))?;
            if let Err(e) = text.parse::<toml::Table>() {
                return Err(ConfigError::Syntax(path.clone(), e.to_string()));
            }
            fig = fig.merge(Toml::file_exact(path));
        }
        if self.use_env {
            fig = fig.merge(Env::prefixed(ENV_PREFIX).filter(|k| k.as_str().contains("__")).split("__"));
        }
        for (key, value) in &self.overrides {
            fig = fig.merge((key.as_str(), parse_flag_value(value)));
        }
        fig.extract::<RunConfig>().map_err(|e| ConfigError::Load(format_figment_error(e)))
    }

    /// One line naming the sources, for the startup printout.
    pub fn describe_sources(&self) -> String {
        let mut parts = vec!["defaults".to_string()];
        if let Some(p) = &self.file {
            parts.push(format!("file {}", p.display()));
        }
        if self.use_env {
            let n = std::env::vars().filter(|(k, _)| k.starts_with(ENV_PREFIX) && k.contains("__")).count();
            if n > 0 {
                parts.push(format!("{n} env var(s)"));
            }
        }
        if !self.overrides.is_empty() {
            parts.push(format!("{} flag(s)", self.overrides.len()));
        }
        parts.join(" < ")
    }
}

/// Parses the TOML text the coordinator hands to roles at registration.
pub fn from_toml_str(text: &str) -> Result<RunConfig, ConfigError> {
    toml::from_str(text).map_err(|e| ConfigError::Load(e.to_string()))
}

/// Serializes the config for registration responses and checkpoints.
pub fn to_toml_string(config: &RunConfig) -> String {
    toml::to_string(config).expect("RunConfig always serializes to TOML")
}

fn parse_flag_value(value: &str) -> toml::Value {
    match format!("v = {value}").parse::<toml::Table>() {
        Ok(mut t) => t.remove("v").unwrap_or_else(|| toml::Value::String(value.into())),
        Err(_) => toml::Value::String(value.to_string()),
    }
}

/// Figment's errors name the key and the source; list all of them.
fn format_figment_error(err: figment::Error) -> String {
    err.into_iter()
        .map(|e| {
            let key = e.path.join(".");
            let source = e
                .metadata
                .as_ref()
                .map(|m| match &m.source {
                    Some(s) => format!("{} {s}", m.name),
                    None => m.name.to_string(),
                })
                .unwrap_or_default();
            let field = if key.is_empty() { String::new() } else { format!("field `{key}`: ") };
            let from = if source.is_empty() { String::new() } else { format!(" (from {source})") };
            format!("{field}{}{from}", e.kind)
        })
        .collect::<Vec<_>>()
        .join("; ")
}
