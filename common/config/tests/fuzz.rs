//! Fuzzing of the config loader and validation: config files built from the
//! real keys with random values (wrong types, negatives, huge numbers, NaN
//! and infinities, empty strings), unknown keys and random text. Every file
//! is loaded or refused with an error that names the file or the key; every
//! loaded config validates or is refused naming fields; every valid config
//! prints its startup block and survives the TOML round trip the
//! coordinator hands to roles. Never a panic. DFLASH_FUZZ_CASES inputs per
//! property (1000 by default); each prints how many it tried.

#![allow(clippy::unwrap_used)] // tests panic on failure by design

use dflash_config::{ConfigError, ConfigLoader, RunConfig, from_toml_str, to_toml_string};
use dflash_fuzz::fuzz;
use proptest::prelude::*;

/// Every leaf key of the config as `(table, key, default value)`.
fn leaf_keys() -> Vec<(String, String, toml::Value)> {
    let table: toml::Table = to_toml_string(&RunConfig::default()).parse().unwrap();
    let mut keys = Vec::new();
    for (section, v) in table {
        if let toml::Value::Table(t) = v {
            keys.extend(t.into_iter().map(|(k, v)| (section.clone(), k, v)));
        }
    }
    assert!(keys.len() > 40, "the config has its sections");
    keys
}

/// A value of the default's own type (what a user is likely to write),
/// awkward ones often; `wrong` picks any type instead.
fn value_like(default: &toml::Value, pick: u64, wrong: bool) -> String {
    const INTS: [i64; 8] = [0, 1, -1, 2, 7, 64, 65_536, i64::MAX];
    const FLOATS: [&str; 9] = ["0.0", "-0.5", "0.5", "1.0", "1e-9", "1e308", "nan", "inf", "-inf"];
    const STRINGS: [&str; 6] = ["\"\"", "\"x\"", "\"bf16\"", "\"cuda:9\"", "\"http://h:1\"", "\"/nonexistent\""];
    const ARRAYS: [&str; 5] = ["[]", "[0]", "[3, 1, 1]", "[1, 2, 40]", "[\"a\"]"];
    let i = pick as usize;
    let kind = if wrong { i % 4 } else { usize::MAX };
    match (default, kind) {
        (toml::Value::Integer(d), usize::MAX) => match i % 3 {
            0 => INTS[i / 3 % INTS.len()].to_string(),
            1 => (d + (i as i64 % 5) - 2).to_string(),
            _ => (d * 2).to_string(),
        },
        (toml::Value::Float(d), usize::MAX) => match i % 2 {
            0 => FLOATS[i / 2 % FLOATS.len()].to_string(),
            _ => format!("{:?}", d * 0.5 + 0.25),
        },
        (toml::Value::Boolean(b), usize::MAX) => (!b).to_string(),
        (toml::Value::String(_), usize::MAX) => STRINGS[i % STRINGS.len()].to_string(),
        (toml::Value::Array(_), usize::MAX) => ARRAYS[i % ARRAYS.len()].to_string(),
        (_, 0) => INTS[i % INTS.len()].to_string(),
        (_, 1) => FLOATS[i % FLOATS.len()].to_string(),
        (_, 2) => STRINGS[i % STRINGS.len()].to_string(),
        _ => ARRAYS[i % ARRAYS.len()].to_string(),
    }
}

/// A config file: a few of the real keys set to random values (mostly of
/// their own type), maybe an unknown key, maybe random text on top.
fn config_file(keys: Vec<(String, String, toml::Value)>) -> impl Strategy<Value = (String, Vec<String>)> {
    let n = keys.len();
    let edits = prop::collection::vec((0..n, any::<u64>(), prop::bool::weighted(0.1)), 1..4);
    let unknown = prop::option::weighted(0.05, "[a-z_]{1,10}");
    let junk = prop::option::weighted(0.05, "\\PC{0,40}");
    (edits, unknown, junk).prop_map(move |(edits, unknown, junk)| {
        let mut by_section: std::collections::BTreeMap<&str, Vec<String>> = Default::default();
        let mut named = Vec::new();
        for (i, pick, wrong) in edits {
            let (section, key, default) = &keys[i];
            if named.contains(key) {
                continue; // TOML refuses a key set twice; that is not what this tests
            }
            by_section.entry(section).or_default().push(format!("{key} = {}", value_like(default, pick, wrong)));
            named.push(key.clone());
        }
        // The two fields every run names, unless this input sets them.
        for (section, key, v) in
            [("model", "target_path", "\"/models/m\""), ("data", "train_path", "\"/data/d.jsonl\"")]
        {
            if !named.iter().any(|k| k == key) {
                by_section.entry(section).or_default().push(format!("{key} = {v}"));
            }
        }
        if let Some(k) = unknown {
            by_section.entry("training").or_default().push(format!("{k}_unknown = 1"));
            named.push(format!("{k}_unknown"));
        }
        let mut text: String =
            by_section.into_iter().map(|(s, lines)| format!("[{s}]\n{}\n", lines.join("\n"))).collect();
        if let Some(j) = junk {
            text.push_str(&j);
        }
        (text, named)
    })
}

#[test]
fn random_config_files_load_validate_or_name_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.toml");
    fuzz("config files, random values for real keys", 1000, config_file(leaf_keys()), |(text, named)| {
        std::fs::write(&path, &text).unwrap();
        let config = match ConfigLoader::new().env(false).file(&path).load() {
            Ok(c) => c,
            Err(e) => {
                let msg = e.to_string();
                let names_it = msg.contains(&path.display().to_string()) || named.iter().any(|k| msg.contains(k));
                assert!(names_it, "the error names the file or a key:\n{text}\n--> {msg}");
                return "refused at load";
            }
        };
        match config.validate() {
            Ok(()) => {
                let _ = config.startup_banner("fuzz", "run");
                let back = from_toml_str(&to_toml_string(&config)).unwrap();
                assert_eq!(back, config, "a valid config survives the round trip:\n{text}");
                "valid"
            }
            Err(ConfigError::Invalid(errors)) => {
                assert!(!errors.is_empty());
                for e in errors {
                    assert!(e.field.contains('.') && !e.message.is_empty(), "{e:?}");
                }
                "refused by validation"
            }
            Err(e) => panic!("validation fails only with field errors: {e}"),
        }
    });
}

#[test]
fn random_text_from_the_coordinator_is_refused_not_trusted() {
    fuzz("config text from the wire, random", 1000, "\\PC{0,200}", |text| match from_toml_str(&text) {
        Ok(c) if c.validate().is_ok() => "valid",
        Ok(_) => "refused by validation",
        Err(_) => "refused at load",
    });
}
