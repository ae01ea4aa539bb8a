//! Writes Hugging Face tokenizer files (tokenizer.json and
//! tokenizer_config.json) for a byte-level BPE tokenizer. Used where no hub
//! is reachable: converting a GGUF's vocabulary and building the synthetic
//! demo model's tokenizer.

use std::path::Path;

use serde_json::json;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, Tokenizer};

use crate::DataError;

/// The ChatML template (SmolLM2's, with its default system prompt made a
/// parameter).
pub fn chatml_template(default_system: Option<&str>) -> String {
    let system = match default_system {
        Some(s) => format!(
            "{{% if loop.first and messages[0]['role'] != 'system' %}}{{{{ '<|im_start|>system\\n{s}<|im_end|>\\n' }}}}{{% endif %}}"
        ),
        None => String::new(),
    };
    format!(
        "{{% for message in messages %}}{system}{{{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}}}{{% endfor %}}{{% if add_generation_prompt %}}{{{{ '<|im_start|>assistant\\n' }}}}{{% endif %}}"
    )
}

/// A byte-level BPE vocabulary.
pub struct BpeSpec {
    /// Token strings in id order (byte-level alphabet, as GPT-2 writes it).
    pub tokens: Vec<String>,
    pub merges: Vec<(String, String)>,
    /// Ids of tokens matched whole before BPE (`<|im_start|>` ...).
    pub special_ids: Vec<u32>,
    /// Split digits one per token before the byte-level regex (SmolLM2).
    pub split_digits: bool,
    pub bos: String,
    pub eos: String,
    pub pad: Option<String>,
    pub chat_template: String,
}

/// GPT-2's reversible byte -> printable char table.
pub fn byte_alphabet() -> Vec<char> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32).collect();
    printable.extend(0xA1..=0xAC);
    printable.extend(0xAE..=0xFF);
    let mut out = vec!['\0'; 256];
    let mut extra = 0;
    for b in 0..256u32 {
        out[b as usize] = if printable.contains(&b) {
            char::from_u32(b).expect("latin-1 range")
        } else {
            extra += 1;
            char::from_u32(255 + extra).expect("small code point")
        };
    }
    out
}

/// Writes `dir/tokenizer.json` and `dir/tokenizer_config.json`.
pub fn write_bpe_tokenizer(dir: &Path, spec: &BpeSpec) -> Result<(), DataError> {
    let err = |e: String| DataError::Tokenizer(dir.join("tokenizer.json"), e);
    let vocab: tokenizers::models::bpe::Vocab =
        spec.tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    if vocab.len() != spec.tokens.len() {
        return Err(err("duplicate token strings in the vocabulary".into()));
    }
    let bpe = BPE::builder().vocab_and_merges(vocab, spec.merges.clone()).build().map_err(|e| err(e.to_string()))?;
    let mut tok = Tokenizer::new(bpe);
    let byte_level = ByteLevel::new(false, true, true);
    let pre: PreTokenizerWrapper = if spec.split_digits {
        Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into()
    } else {
        byte_level.into()
    };
    tok.with_pre_tokenizer(Some(pre));
    tok.with_decoder(Some(ByteLevel::default()));
    let specials: Vec<AddedToken> =
        spec.special_ids.iter().map(|&i| AddedToken::from(spec.tokens[i as usize].clone(), true)).collect();
    tok.add_special_tokens(&specials);
    tok.save(dir.join("tokenizer.json"), false).map_err(|e| err(e.to_string()))?;

    let config = json!({
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": spec.bos,
        "eos_token": spec.eos,
        "pad_token": spec.pad,
        "unk_token": spec.eos,
        "add_bos_token": false,
        "model_max_length": 8192,
        "chat_template": spec.chat_template,
    });
    let path = dir.join("tokenizer_config.json");
    std::fs::write(&path, serde_json::to_string_pretty(&config).expect("json"))
        .map_err(|e| DataError::Io(path, e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alphabet_is_a_bijection_onto_printables() {
        let a = byte_alphabet();
        let mut s = a.clone();
        s.sort();
        s.dedup();
        assert_eq!(s.len(), 256);
        assert_eq!(a[b'A' as usize], 'A');
        assert_eq!(a[b' ' as usize], 'Ġ');
        assert_eq!(a[b'\n' as usize], 'Ċ');
    }
}
