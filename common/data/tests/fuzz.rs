//! Fuzzing of the dataset reader: random JSONL files -- random bytes, and
//! lines built from the pieces of real chat lines (keys, roles, nesting,
//! escapes, invalid UTF-8) -- are either read into samples whose masks fit
//! their tokens, or refused with an error that names the file and a line
//! that exists. Never a panic. DFLASH_FUZZ_CASES inputs per property
//! (by default 1000 files, 3000 lines); each prints what became of them.

#![allow(clippy::unwrap_used)] // tests panic on failure by design

use std::path::Path;

use dflash_data::{ChatTokenizer, Conversation, DataError, Dataset, LoadOptions, write_synthetic_tokenizer};
use dflash_fuzz::fuzz;
use proptest::prelude::*;

/// One JSONL line from the pieces real lines are made of, some of them wrong.
fn chat_line() -> impl Strategy<Value = Vec<u8>> {
    let role = prop_oneof![
        12 => Just("user"),
        12 => Just("assistant"),
        1 => Just("system"),
        1 => Just("tool"),
        1 => Just(""),
        1 => Just("ASSISTANT"),
    ];
    let text = prop_oneof![
        8 => "[a-z ]{0,40}",
        1 => "\\PC{0,30}",
        1 => Just("\\u0000 nul".to_string()),
        1 => Just("\\ud800 lone surrogate".to_string()),
        1 => Just("<|im_start|>assistant".to_string()),
        1 => Just("a\\nb\\tc \\\"quoted\\\"".to_string()),
        1 => "[a-z]{200,600}",
    ];
    // ShareGPT lines name speakers differently; the key picks the form.
    let turn = (role, text, prop::bool::weighted(0.05)).prop_map(|(role, text, numeric)| {
        let value = if numeric { "42".to_string() } else { format!("\"{text}\"") };
        (role.to_string(), value)
    });
    let key = prop_oneof![8 => Just("messages"), 8 => Just("conversations"), 1 => Just("msgs")];
    let body = (key, prop::collection::vec(turn, 1..5), 0u8..40, prop::collection::vec(any::<u8>(), 0..4));
    body.prop_map(|(key, turns, damage, junk)| {
        let turns: Vec<String> = turns
            .into_iter()
            .map(|(role, value)| match key {
                "conversations" => {
                    let from = match role.as_str() {
                        "user" => "human",
                        "assistant" => "gpt",
                        other => other,
                    };
                    format!("{{\"from\": \"{from}\", \"value\": {value}}}")
                }
                _ => format!("{{\"role\": \"{role}\", \"content\": {value}}}"),
            })
            .collect();
        let mut line = format!("{{\"{key}\": [{}]}}", turns.join(", ")).into_bytes();
        match damage {
            0 => line.truncate(line.len() / 2),                  // cut short
            1 => line.extend_from_slice(&junk),                  // trailing bytes
            2 => line.splice(1..1, [0xff, 0xfe]).for_each(drop), // not UTF-8
            3 => line = b"[1, 2, 3]".to_vec(),
            4 => line = format!("{{\"{key}\": []}}").into_bytes(), // valid JSON, wrong shape
            _ => {}
        }
        line
    })
}

/// A file of such lines, with blank lines and random byte lines mixed in.
fn jsonl_file() -> impl Strategy<Value = Vec<Vec<u8>>> {
    let line = prop_oneof![
        12 => chat_line(),
        1 => prop::collection::vec(any::<u8>(), 0..80).prop_map(|mut v| { v.retain(|&b| b != b'\n'); v }),
        1 => Just(Vec::new()),
    ];
    prop::collection::vec(line, 0..8)
}

fn check_load(dir: &Path, tok: &ChatTokenizer, lines: &[Vec<u8>], opts: &LoadOptions) -> &'static str {
    let path = dir.join("data.jsonl");
    let bytes = lines.join(&b'\n');
    std::fs::write(&path, &bytes).unwrap();
    // Generated lines may hold newlines of their own: the file's lines are
    // what its newlines make (the fuzzer found a "line 2" of one line).
    let file_lines = bytes.split(|&b| b == b'\n').count();
    match Dataset::load(&path, tok, opts) {
        Ok(d) => {
            assert!(!d.samples.is_empty(), "a loaded dataset has samples");
            for s in &d.samples {
                assert_eq!(s.input_ids.len(), s.loss_mask.len());
                assert!(s.input_ids.len() <= opts.max_seq_len);
                assert!(s.input_ids.iter().all(|&id| id < tok.vocab_size()), "ids inside the vocabulary");
            }
            assert!(d.report.malformed_skipped == 0 || opts.skip_malformed);
            if d.report.malformed_skipped > 0 { "loaded, skipping lines" } else { "loaded" }
        }
        Err(DataError::Malformed { path: p, line, reason }) => {
            assert_eq!(p, path);
            assert!(line >= 1 && line as usize <= file_lines, "line {line} of {file_lines} lines");
            assert!(!opts.skip_malformed, "skipping malformed lines never fails on one: {reason}");
            assert!(!reason.is_empty());
            "refused naming a line"
        }
        Err(e) => {
            let text = e.to_string();
            assert!(text.contains(&path.display().to_string()), "the error names the file: {text}");
            "refused naming the file"
        }
    }
}

#[test]
fn random_jsonl_files_load_or_are_refused_naming_the_line() {
    let dir = tempfile::tempdir().unwrap();
    write_synthetic_tokenizer(dir.path()).unwrap();
    let tok = ChatTokenizer::from_dir(dir.path()).unwrap();
    let strict = LoadOptions::strict(64);
    let lenient = LoadOptions { max_seq_len: 64, skip_malformed: true, max_skipped_fraction: 0.5 };
    fuzz("dataset files, strict and skipping", 1000, jsonl_file(), |lines| {
        let strict = check_load(dir.path(), &tok, &lines, &strict);
        let lenient = check_load(dir.path(), &tok, &lines, &lenient);
        match (strict, lenient) {
            ("loaded", _) => "strict: loaded",
            (_, "loaded, skipping lines") => "strict: refused; skipping: loaded",
            _ => "refused either way",
        }
    });
}

#[test]
fn any_line_parses_or_says_why() {
    fuzz("chat line parser", 3000, chat_line(), |line| {
        let Ok(text) = std::str::from_utf8(&line) else { return "not UTF-8" };
        match Conversation::parse_line(text) {
            Ok(c) => {
                assert!(!c.messages.is_empty());
                "parsed"
            }
            Err(reason) => {
                assert!(!reason.is_empty());
                "refused"
            }
        }
    });
}
