//! The target's tokenizer and chat template, and assistant-only loss masks.

use std::path::{Path, PathBuf};

use minijinja::{Environment, context};
use serde_json::Value;
use tokenizers::Tokenizer;

use crate::{DataError, Message};

/// Token ids and each token's byte span in the text.
type TokensWithOffsets = (Vec<u32>, Vec<(usize, usize)>);

/// Tokenizer (tokenizer.json) plus chat template and special tokens
/// (tokenizer_config.json) of a Hugging Face model directory.
pub struct ChatTokenizer {
    tokenizer: Tokenizer,
    template: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// Token ids that end a generation (eos, end of turn).
    pub stop_ids: Vec<u32>,
    pub pad_id: Option<u32>,
    pub bos_id: Option<u32>,
    /// Most text bytes one token stands for (its vocabulary string's
    /// length bounds it): how much of a long text can matter to its first
    /// n tokens.
    pub max_token_bytes: usize,
    dir: PathBuf,
}

/// Token ids of a conversation and which of them are trained on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Encoded {
    pub input_ids: Vec<u32>,
    /// 1 for tokens inside assistant turns (content and end-of-turn), else 0.
    pub loss_mask: Vec<u8>,
}

fn token_string(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

impl ChatTokenizer {
    /// Loads `dir/tokenizer.json` and `dir/tokenizer_config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self, DataError> {
        let tok_path = dir.join("tokenizer.json");
        let tokenizer =
            Tokenizer::from_file(&tok_path).map_err(|e| DataError::Tokenizer(tok_path.clone(), e.to_string()))?;
        let cfg_path = dir.join("tokenizer_config.json");
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| DataError::Io(cfg_path.clone(), e.to_string()))?;
        let cfg: Value =
            serde_json::from_str(&text).map_err(|e| DataError::Tokenizer(cfg_path.clone(), e.to_string()))?;
        let template_src = match cfg.get("chat_template") {
            Some(Value::String(s)) => s.clone(),
            // A list of named templates: take "default".
            Some(Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template").and_then(Value::as_str))
                .map(str::to_string)
                .ok_or_else(|| DataError::Tokenizer(cfg_path.clone(), "no \"default\" chat template".into()))?,
            _ => {
                return Err(DataError::Tokenizer(
                    cfg_path,
                    "has no \"chat_template\"; a chat model is required".into(),
                ));
            }
        };
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned("chat", template_src)
            .map_err(|e| DataError::Template(cfg_path.clone(), e.to_string()))?;

        let bos_token = token_string(cfg.get("bos_token")).unwrap_or_default();
        let eos_token = token_string(cfg.get("eos_token")).unwrap_or_default();
        let pad_token = token_string(cfg.get("pad_token"));
        let id = |t: &str| if t.is_empty() { None } else { tokenizer.token_to_id(t) };
        let mut stop_ids: Vec<u32> = id(&eos_token).into_iter().collect();
        for t in ["<|im_end|>", "<|eot_id|>", "<|endoftext|>"] {
            if let Some(i) = tokenizer.token_to_id(t)
                && !stop_ids.contains(&i)
            {
                stop_ids.push(i);
            }
        }
        let pad_id = pad_token.as_deref().and_then(id);
        let bos_id = id(&bos_token);
        // A vocabulary string's UTF-8 length bounds the text bytes its token
        // decodes to (byte-level BPE maps each byte to one or two bytes of
        // its string; SentencePiece strings are the text or longer).
        let max_token_bytes = tokenizer.get_vocab(true).keys().map(String::len).max().unwrap_or(1);
        Ok(Self {
            tokenizer,
            template: env,
            bos_token,
            eos_token,
            stop_ids,
            pad_id,
            bos_id,
            max_token_bytes,
            dir: dir.to_path_buf(),
        })
    }

    /// The model folder the tokenizer was read from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn vocab_size(&self) -> u32 {
        self.tokenizer.get_vocab_size(true) as u32
    }

    /// Bytes of text that can hold `tokens` tokens at most: text beyond it
    /// cannot change the first `tokens` tokens.
    pub fn text_budget(&self, tokens: usize) -> usize {
        tokens.saturating_mul(self.max_token_bytes.max(1))
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    /// Plain text to ids (no special tokens added).
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>, DataError> {
        Ok(self.encode_with_offsets(text)?.0)
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String, DataError> {
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| DataError::Tokenizer(self.dir.join("tokenizer.json"), e.to_string()))
    }

    /// Renders messages with the chat template.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String, DataError> {
        let tmpl = self.template.get_template("chat").expect("registered in from_dir");
        tmpl.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })
        .map_err(|e| DataError::Template(self.dir.join("tokenizer_config.json"), format!("{e:#}")))
    }

    /// Ids of a prompt ending in the generation prompt (for decoding).
    pub fn encode_prompt(&self, messages: &[Message]) -> Result<Vec<u32>, DataError> {
        self.encode_text(&self.render(messages, true)?)
    }

    /// Tokenizes a whole conversation once and marks the tokens of assistant
    /// turns. Each assistant span runs from the end of the generation prompt
    /// that precedes it to the end of its rendered turn, so the end-of-turn
    /// token is trained on too.
    pub fn encode_conversation(&self, messages: &[Message]) -> Result<Encoded, DataError> {
        let full = self.render(messages, false)?;
        let mut spans = Vec::new();
        for (i, m) in messages.iter().enumerate() {
            if !m.is_assistant() {
                continue;
            }
            let before = self.render(&messages[..i], true)?;
            let through = self.render(&messages[..=i], false)?;
            if !full.starts_with(&before) || !full.starts_with(&through) || through.len() < before.len() {
                return Err(DataError::Template(
                    self.dir.join("tokenizer_config.json"),
                    "the chat template does not render conversations prefix by prefix; \
                     assistant spans cannot be located"
                        .into(),
                ));
            }
            spans.push((before.len(), through.len()));
        }
        let (input_ids, offsets) = self.encode_with_offsets(&full)?;
        let loss_mask =
            offsets.iter().map(|&(start, _)| u8::from(spans.iter().any(|&(s, e)| (s..e).contains(&start)))).collect();
        Ok(Encoded { input_ids, loss_mask })
    }

    fn encode_with_offsets(&self, text: &str) -> Result<TokensWithOffsets, DataError> {
        let enc = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| DataError::Tokenizer(self.dir.join("tokenizer.json"), e.to_string()))?;
        Ok((enc.get_ids().to_vec(), enc.get_offsets().to_vec()))
    }
}
