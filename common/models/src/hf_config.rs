//! A Hugging Face `config.json` read field by field.
//!
//! Every field a family reads is taken out of the map; what is left after
//! the family has read its own must be a field known not to change the
//! forward pass (generation defaults, training-only settings, metadata).
//! Anything else is refused by name: a field we do not read may change the
//! math, and a target computed with different math ships wrong features
//! without any error.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::ModelError;

/// Fields every `PretrainedConfig` may carry that do not change a frozen
/// forward: metadata, special token ids, generation defaults (transformers
/// 4.x wrote those into config.json), training-only knobs, output switches.
const HARMLESS: &[&str] = &[
    "_name_or_path",
    "_attn_implementation_autoset",
    "add_cross_attention",
    "architectures",
    "attention_dropout",
    "auto_map",
    "bad_words_ids",
    "begin_suppress_tokens",
    "bos_token_id",
    "chunk_size_feed_forward",
    "cross_attention_hidden_size",
    "decoder_start_token_id",
    "diversity_penalty",
    "do_sample",
    "dtype",
    "early_stopping",
    "encoder_no_repeat_ngram_size",
    "eos_token_id",
    "exponential_decay_length_penalty",
    "finetuning_task",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "id2label",
    "initializer_range",
    "is_decoder",
    "is_encoder_decoder",
    "label2id",
    "length_penalty",
    "max_length",
    "min_length",
    "model_type",
    "no_repeat_ngram_size",
    "num_beam_groups",
    "num_beams",
    "num_return_sequences",
    "output_attentions",
    "output_hidden_states",
    "output_scores",
    "pad_token_id",
    "prefix",
    "problem_type",
    "pruned_heads",
    "remove_invalid_values",
    "repetition_penalty",
    "return_dict",
    "return_dict_in_generate",
    "sep_token_id",
    "suppress_tokens",
    "task_specific_params",
    "temperature",
    "tf_legacy_loss",
    "tie_encoder_decoder",
    "tokenizer_class",
    "top_k",
    "top_p",
    "torch_dtype",
    "torchscript",
    "transformers_version",
    "typical_p",
    "use_bfloat16",
    "use_cache",
];

/// The fields of one config.json, taken out as they are read.
pub struct HfConfig {
    path: PathBuf,
    fields: BTreeMap<String, Value>,
    /// The architecture name it was resolved by, for messages.
    pub architecture: String,
    /// Where these fields sit in the file (`text_config.` for a nested
    /// config), for messages.
    scope: String,
}

impl HfConfig {
    /// Reads `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
        Self::parse(&path, &text)
    }

    /// Parses config text; `path` names it in errors.
    pub fn parse(path: &Path, text: &str) -> Result<Self, ModelError> {
        let value: Value = serde_json::from_str(text)
            .map_err(|e| ModelError::Config { path: path.to_path_buf(), message: format!("not JSON: {e}") })?;
        let Value::Object(map) = value else {
            return Err(ModelError::Config { path: path.to_path_buf(), message: "is not a JSON object".into() });
        };
        let architecture = match (map.get("architectures"), map.get("model_type")) {
            (Some(Value::Array(a)), _) if !a.is_empty() => a[0].as_str().unwrap_or_default().to_string(),
            (_, Some(Value::String(t))) => t.clone(),
            _ => String::new(),
        };
        Ok(Self { path: path.to_path_buf(), fields: map.into_iter().collect(), architecture, scope: String::new() })
    }

    /// The object `field` (e.g. a multimodal checkpoint's `text_config`)
    /// as a config of its own, taken out of this one; errors about its
    /// fields name them as `field.key`. None when absent.
    pub fn nested(&mut self, field: &str) -> Result<Option<HfConfig>, ModelError> {
        let Some(map) = self.opt::<serde_json::Map<String, Value>>(field)? else { return Ok(None) };
        Ok(Some(Self {
            path: self.path.clone(),
            fields: map.into_iter().collect(),
            architecture: self.architecture.clone(),
            scope: format!("{}{field}.", self.scope),
        }))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// An error about `field`, naming the file.
    pub fn error(&self, field: &str, message: impl std::fmt::Display) -> ModelError {
        ModelError::Config { path: self.path.clone(), message: format!("field \"{}{field}\": {message}", self.scope) }
    }

    /// Whether `field` is present and not null (without reading it).
    pub fn has(&self, field: &str) -> bool {
        self.fields.get(field).is_some_and(|v| !v.is_null())
    }

    /// Whether the key is in the file at all (also when null).
    pub fn present(&self, field: &str) -> bool {
        self.fields.contains_key(field)
    }

    /// Reads an optional field; `null` counts as absent.
    pub fn opt<T: DeserializeOwned>(&mut self, field: &str) -> Result<Option<T>, ModelError> {
        match self.fields.remove(field) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => {
                let shown = v.to_string();
                serde_json::from_value(v).map(Some).map_err(|e| self.error(field, format!("{shown}: {e}")))
            }
        }
    }

    /// Reads a required field.
    pub fn req<T: DeserializeOwned>(&mut self, field: &str) -> Result<T, ModelError> {
        self.opt(field)?.ok_or_else(|| self.error(field, "is missing"))
    }

    /// Reads a field with a default (the default transformers applies).
    pub fn or<T: DeserializeOwned>(&mut self, field: &str, default: T) -> Result<T, ModelError> {
        Ok(self.opt(field)?.unwrap_or(default))
    }

    /// Reads a positive integer.
    pub fn positive(&mut self, field: &str) -> Result<i64, ModelError> {
        let v: i64 = self.req(field)?;
        if v <= 0 {
            return Err(self.error(field, format!("must be positive, got {v}")));
        }
        Ok(v)
    }

    /// Marks fields of this family as read although they do not change the
    /// forward (e.g. `pretraining_tp`, which only splits matmuls).
    pub fn ignore(&mut self, fields: &[&str]) {
        for f in fields {
            self.fields.remove(*f);
        }
    }

    /// Checks that nothing is left but fields known to be harmless: every
    /// other field would be a setting this code does not implement.
    pub fn finish(mut self) -> Result<(), ModelError> {
        self.ignore(HARMLESS);
        if let Some((field, value)) = self.fields.iter().next() {
            let arch = &self.architecture;
            return Err(self.error(
                field,
                format!(
                    "{value} is not read by dflash's {arch} and may change the model's math, so the model is \
                     refused rather than computed differently from its definition (if the field is only \
                     metadata your tools added, remove it from config.json)"
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(text: &str) -> HfConfig {
        HfConfig::parse(Path::new("/m/config.json"), text).expect("parses")
    }

    #[test]
    fn fields_are_taken_once_and_leftovers_refused_by_name() {
        let mut c =
            cfg(r#"{"architectures": ["X"], "hidden_size": 8, "bos_token_id": 1, "attn_logit_softcapping": 30}"#);
        assert_eq!(c.architecture, "X");
        assert_eq!(c.req::<i64>("hidden_size").expect("present"), 8);
        assert!(c.opt::<i64>("hidden_size").expect("read").is_none(), "a field is read once");
        let err = c.finish().expect_err("softcapping is not read").to_string();
        assert!(err.contains("/m/config.json") && err.contains("attn_logit_softcapping"), "{err}");
    }

    #[test]
    fn nulls_are_absent_and_wrong_types_name_the_field() {
        let mut c = cfg(r#"{"rope_scaling": null, "head_dim": "eight"}"#);
        assert!(c.opt::<Value>("rope_scaling").expect("null").is_none());
        let err = c.req::<i64>("head_dim").expect_err("not a number").to_string();
        assert!(err.contains("head_dim") && err.contains("eight"), "{err}");
        assert!(c.finish().is_ok());
    }
}
