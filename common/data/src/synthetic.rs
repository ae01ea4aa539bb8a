//! A generated chat dataset with learnable structure (counting, repeating,
//! spelling, adding), for the demo model and the tests: real JSONL in the
//! OpenAI `messages` form, deterministic from a seed.

use std::io::Write;
use std::path::Path;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::{Conversation, DataError, Message};

const WORDS: &[&str] = &[
    "apple", "river", "stone", "cloud", "light", "green", "table", "music", "paper", "ocean", "tiger", "bread",
    "chair", "dream", "flame", "grass", "honey", "lemon", "mango", "night",
];

/// One generated conversation.
pub fn synthetic_conversation(rng: &mut impl Rng) -> Conversation {
    let (q, a) = match rng.random_range(0..4) {
        0 => {
            let start = rng.random_range(1..60);
            let end = start + rng.random_range(4..16);
            let nums: Vec<String> = (start..=end).map(|n: u32| n.to_string()).collect();
            (format!("Count from {start} to {end}."), nums.join(" "))
        }
        1 => {
            let n = rng.random_range(3..8);
            let words: Vec<&str> = (0..n).map(|_| WORDS[rng.random_range(0..WORDS.len())]).collect();
            (format!("Repeat after me: {}", words.join(" ")), words.join(" "))
        }
        2 => {
            let w = WORDS[rng.random_range(0..WORDS.len())];
            let spelled: Vec<String> = w.chars().map(String::from).collect();
            (format!("Spell {w}."), format!("{w} is spelled {}.", spelled.join("-")))
        }
        _ => {
            let (x, y) = (rng.random_range(1..500u32), rng.random_range(1..500u32));
            (format!("What is {x} plus {y}?"), format!("{x} plus {y} is {}.", x + y))
        }
    };
    Conversation { messages: vec![Message::new("user", q), Message::new("assistant", a)] }
}

/// Writes `n` generated conversations to `path` as JSONL.
pub fn write_synthetic_dataset(path: &Path, n: usize, seed: u64) -> Result<(), DataError> {
    let io = |e: std::io::Error| DataError::Io(path.to_path_buf(), e.to_string());
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut out = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
    for _ in 0..n {
        let line = serde_json::to_string(&synthetic_conversation(&mut rng)).expect("json");
        writeln!(out, "{line}").map_err(io)?;
    }
    out.flush().map_err(io)
}

/// Writes `n` conversations whose answers run `min_tokens..=max_tokens`
/// bytes (= tokens of the byte-level synthetic tokenizer), built from many
/// generated answers: realistic lengths for throughput runs.
pub fn write_long_synthetic_dataset(
    path: &Path,
    n: usize,
    seed: u64,
    min_tokens: usize,
    max_tokens: usize,
) -> Result<(), DataError> {
    let io = |e: std::io::Error| DataError::Io(path.to_path_buf(), e.to_string());
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut out = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
    for _ in 0..n {
        let target = rng.random_range(min_tokens..=max_tokens.max(min_tokens));
        let first = synthetic_conversation(&mut rng);
        let mut answer = first.messages[1].content.clone();
        while answer.len() < target {
            answer.push(' ');
            answer.push_str(&synthetic_conversation(&mut rng).messages[1].content);
        }
        answer.truncate(target);
        let conv = Conversation { messages: vec![first.messages[0].clone(), Message::new("assistant", answer)] };
        writeln!(out, "{}", serde_json::to_string(&conv).expect("json")).map_err(io)?;
    }
    out.flush().map_err(io)
}

/// Special tokens of the synthetic tokenizer, laid out like SmolLM2's: 0
/// `<|endoftext|>`, 1 `<|im_start|>` (bos), 2 `<|im_end|>` (eos, pad), 3-16
/// reserved (unused by chat data; one of them serves as the mask token).
pub const SYNTHETIC_SPECIALS: usize = 17;

/// Writes a byte-level tokenizer (17 specials + 256 bytes, no merges) with
/// the ChatML template to `dir`.
pub fn write_synthetic_tokenizer(dir: &Path) -> Result<(), DataError> {
    let mut tokens: Vec<String> = vec!["<|endoftext|>".into(), "<|im_start|>".into(), "<|im_end|>".into()];
    tokens.extend((3..SYNTHETIC_SPECIALS).map(|i| format!("<|reserved_{i}|>")));
    tokens.extend(crate::byte_alphabet().into_iter().map(String::from));
    crate::write_bpe_tokenizer(
        dir,
        &crate::BpeSpec {
            tokens,
            merges: Vec::new(),
            special_ids: (0..SYNTHETIC_SPECIALS as u32).collect(),
            split_digits: false,
            bos: "<|im_start|>".into(),
            eos: "<|im_end|>".into(),
            pad: Some("<|im_end|>".into()),
            chat_template: crate::chatml_template(None),
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ChatTokenizer, Dataset, LoadOptions};

    fn tokenizer() -> (tempfile::TempDir, ChatTokenizer) {
        let dir = tempfile::tempdir().unwrap();
        write_synthetic_tokenizer(dir.path()).unwrap();
        let tok = ChatTokenizer::from_dir(dir.path()).unwrap();
        (dir, tok)
    }

    #[test]
    fn chatml_renders_and_round_trips() {
        let (_d, tok) = tokenizer();
        let msgs = vec![Message::new("user", "hi"), Message::new("assistant", "yo")];
        let text = tok.render(&msgs, false).unwrap();
        assert_eq!(text, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n");
        let ids = tok.encode_text(&text).unwrap();
        // specials are single tokens; every other byte is one token
        assert_eq!(ids[0], 1);
        // 4 specials, the bytes of both turns, and the newline after each <|im_end|>
        assert_eq!(ids.len(), 4 + "user\nhi".len() + "assistant\nyo".len() + 2);
        assert_eq!(tok.stop_ids[0], 2);
    }

    #[test]
    fn loss_mask_covers_assistant_content_and_end_of_turn_only() {
        let (_d, tok) = tokenizer();
        let msgs = vec![
            Message::new("user", "hi"),
            Message::new("assistant", "yo"),
            Message::new("user", "ok"),
            Message::new("assistant", "go"),
        ];
        let enc = tok.encode_conversation(&msgs).unwrap();
        let trained: Vec<u32> =
            enc.input_ids.iter().zip(&enc.loss_mask).filter(|(_, m)| **m == 1).map(|(i, _)| *i).collect();
        let expect = tok.encode_text("yo<|im_end|>\ngo<|im_end|>\n").unwrap();
        assert_eq!(trained, expect);
    }

    #[test]
    fn dataset_loads_truncates_and_names_bad_lines() {
        let (dir, tok) = tokenizer();
        let path = dir.path().join("d.jsonl");
        write_synthetic_dataset(&path, 20, 1).unwrap();
        let opts = LoadOptions::strict(40);
        let ds = Dataset::load(&path, &tok, &opts).unwrap();
        assert_eq!(ds.samples.len() as u64 + ds.report.without_targets, 20);
        assert!(ds.samples.iter().all(|s| s.len() <= 40));
        assert!(ds.report.truncated > 0);

        let mut text = std::fs::read_to_string(&path).unwrap();
        text.push_str("{\"messages\": [oops\n");
        std::fs::write(&path, text).unwrap();
        let err = Dataset::load(&path, &tok, &opts).err().unwrap().to_string();
        assert!(err.contains("d.jsonl:21: malformed line"), "{err}");
        let ds = Dataset::load(&path, &tok, &LoadOptions { skip_malformed: true, max_skipped_fraction: 1.0, ..opts })
            .unwrap();
        assert_eq!(ds.report.malformed_skipped, 1);
    }

    #[test]
    fn bytes_that_are_not_utf8_name_their_line_and_follow_the_skip_policy() {
        let (dir, tok) = tokenizer();
        let path = dir.path().join("d.jsonl");
        write_synthetic_dataset(&path, 5, 1).unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        bytes.extend_from_slice(b"{\"messages\": [{\"role\": \"user\", \"content\": \"caf\xe9\"}]}\n");
        std::fs::write(&path, &bytes).unwrap();
        let err = Dataset::load(&path, &tok, &LoadOptions::strict(40)).err().unwrap().to_string();
        assert!(err.contains("d.jsonl:6:") && err.contains("not UTF-8"), "{err}");
        let skip = LoadOptions { skip_malformed: true, max_skipped_fraction: 0.5, ..LoadOptions::strict(40) };
        let ds = Dataset::load(&path, &tok, &skip).unwrap();
        assert_eq!((ds.report.malformed_skipped, ds.report.lines), (1, 6));
    }

    #[test]
    fn a_file_that_is_mostly_malformed_fails_even_under_the_skip_policy() {
        let (dir, tok) = tokenizer();
        let path = dir.path().join("d.jsonl");
        write_synthetic_dataset(&path, 2, 1).unwrap();
        let mut text = std::fs::read_to_string(&path).unwrap();
        for _ in 0..8 {
            text.push_str("not json\n");
        }
        std::fs::write(&path, text).unwrap();
        let skip = LoadOptions { skip_malformed: true, max_skipped_fraction: 0.5, ..LoadOptions::strict(40) };
        let err = Dataset::load(&path, &tok, &skip).err().unwrap().to_string();
        assert!(err.contains("8 of 10 lines are malformed") && err.contains("d.jsonl:3:"), "{err}");
    }

    #[test]
    fn an_overlong_line_is_cut_before_tokenizing_to_the_same_tokens() {
        let (dir, tok) = tokenizer();
        let path = dir.path().join("d.jsonl");
        let long: String = (0..200_000).map(|i| char::from(b'a' + (i % 26) as u8)).collect();
        let msgs = vec![Message::new("user", "hi"), Message::new("assistant", long.clone())];
        let line = serde_json::json!({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": long}]});
        std::fs::write(&path, format!("{line}\n")).unwrap();
        let max = 64;
        assert!(line.to_string().len() > 2 * tok.text_budget(max), "the line must be long enough to be cut");
        let ds = Dataset::load(&path, &tok, &LoadOptions::strict(max)).unwrap();
        let whole = tok.encode_conversation(&msgs).unwrap();
        assert_eq!(ds.samples[0].input_ids, whole.input_ids[..max]);
        assert_eq!(ds.samples[0].loss_mask, whole.loss_mask[..max]);
        assert_eq!(ds.report.truncated, 1);
    }
}
