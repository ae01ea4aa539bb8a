//! `dflash regenerate`: the target answers a dataset's prompts
//! itself (greedy, batched, KV cache) and the answers become the training
//! data, as every public DFlash recipe does.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use dflash_data::{ChatTokenizer, Conversation, Message};
use dflash_models::generate::greedy_generate;
use dflash_models::{LoadScope, TargetModel};
use tch::{Device, Kind};

use crate::meter::Meter;

/// Which prompts of a JSONL or Parquet file to decode, and how far.
#[derive(clap::Args, Debug, Clone)]
pub struct PromptSlice {
    /// Skip this many lines first.
    #[arg(long, default_value_t = 0)]
    pub offset: usize,
    /// Decode at most this many prompts (0: all).
    #[arg(long, default_value_t = 0)]
    pub limit: usize,
    #[arg(long, default_value_t = 96)]
    pub max_new_tokens: usize,
}

#[derive(clap::Args, Debug)]
pub struct RegenArgs {
    /// Target model directory, or a repo id ORG/NAME[@REVISION] in the
    /// Hugging Face cache.
    #[arg(long, value_parser = dflash_config::hub::resolve_model_dir)]
    pub model: PathBuf,
    /// JSONL or Parquet conversations; each one's turns before the first
    /// assistant turn are the prompt.
    #[arg(long)]
    pub input: PathBuf,
    /// JSONL to write: prompt plus the target's answer.
    #[arg(long)]
    pub output: PathBuf,
    #[command(flatten)]
    pub prompts: PromptSlice,
    /// Prompts decoded together.
    #[arg(long, default_value_t = 16)]
    pub batch_size: usize,
    /// Cap on a batch's padded tokens (prompts x (longest prompt + new
    /// tokens)): the attention mask and scores grow with the square of the
    /// longest prompt, so long prompts decode in smaller batches.
    #[arg(long, default_value_t = 32_768)]
    pub max_batch_tokens: usize,
    /// Prompts longer than this are skipped (and counted in the log).
    #[arg(long, default_value_t = 4096)]
    pub max_prompt_tokens: usize,
    /// Device: "cpu" or a GPU index.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// CPU threads for libtorch (0: default).
    #[arg(long, default_value_t = 0)]
    pub threads: i32,
}

struct Prompt {
    line: serde_json::Value,
    messages: Vec<Message>,
    ids: Vec<u32>,
}

/// The prompts of a JSONL or Parquet file (see
/// [`dflash_models::evaluation::prompt_records`]).
fn read_prompts(path: &Path, tok: &ChatTokenizer, offset: usize, limit: usize) -> anyhow::Result<Vec<Prompt>> {
    let mut out = Vec::new();
    for (at, record) in dflash_models::evaluation::prompt_records(path)?.into_iter().skip(offset) {
        if limit > 0 && out.len() == limit {
            break;
        }
        let Some(record) = record else { continue };
        let bad = |e: String| anyhow::anyhow!("{}: {at}: {e}", path.display());
        let line = record.map_err(bad)?;
        let conv = Conversation::from_json(line.clone()).map_err(bad)?;
        let messages = conv.first_prompt();
        if messages.is_empty() {
            return Err(bad("the conversation starts with an assistant turn".into()));
        }
        let ids = tok.encode_prompt(&messages)?;
        out.push(Prompt { line, messages, ids });
    }
    Ok(out)
}

pub fn regenerate(a: &RegenArgs) -> anyhow::Result<()> {
    if a.threads > 0 {
        tch::set_num_threads(a.threads);
    }
    let device = match a.device.as_str() {
        "cpu" => Device::Cpu,
        i => {
            let i: u32 = i.parse().with_context(|| format!("--device {i}: use cpu or a GPU index"))?;
            dflash_models::cuda::tch_device(Some(i))?
        }
    };
    let kind = if device.is_cuda() { Kind::BFloat16 } else { Kind::Float };
    let tok = ChatTokenizer::from_dir(&a.model)?;
    let target = TargetModel::load(&a.model, device, kind, LoadScope::Full)?;
    let prompts = read_prompts(&a.input, &tok, a.prompts.offset, a.prompts.limit)?;
    let too_long = prompts.iter().filter(|p| p.ids.len() > a.max_prompt_tokens).count();
    if too_long > 0 {
        tracing::warn!(
            "skipping {too_long} of {} prompts longer than {} tokens (--max-prompt-tokens)",
            prompts.len(),
            a.max_prompt_tokens
        );
    }
    // Decode similar lengths together (less padding); write in input order.
    let mut order: Vec<usize> = (0..prompts.len()).filter(|&i| prompts[i].ids.len() <= a.max_prompt_tokens).collect();
    order.sort_by_key(|&i| prompts[i].ids.len());
    let lens: Vec<usize> = order.iter().map(|&i| prompts[i].ids.len()).collect();
    let mut answers: Vec<Option<String>> = vec![None; prompts.len()];
    let started = Instant::now();
    let mut generated = 0usize;
    let mut meter = Meter::new("regenerate", order.len() as u64, "prompts");
    for range in plan_batches(&lens, a.batch_size, a.max_batch_tokens, a.prompts.max_new_tokens) {
        let chunk = &order[range];
        let batch: Vec<Vec<u32>> = chunk.iter().map(|&i| prompts[i].ids.clone()).collect();
        let outs = greedy_generate(&target, &batch, a.prompts.max_new_tokens, &tok.stop_ids);
        for (&i, ids) in chunk.iter().zip(outs) {
            generated += ids.len();
            answers[i] = Some(tok.decode(&ids)?.trim().to_string());
        }
        meter.add(
            chunk.len() as u64,
            &format!("{:.0} new tokens/s", generated as f64 / started.elapsed().as_secs_f64()),
        );
    }
    meter.finish();
    let tmp = a.output.with_extension("tmp");
    if let Some(dir) = a.output.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut w = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
    let mut written = 0;
    for (p, answer) in prompts.into_iter().zip(answers) {
        let answer = answer.unwrap_or_default();
        if answer.is_empty() {
            continue;
        }
        let mut line = p.line;
        let mut messages = p.messages;
        messages.push(Message::new("assistant", answer));
        line["messages"] = serde_json::to_value(&messages)?;
        if let Some(o) = line.as_object_mut() {
            o.remove("conversations");
        }
        writeln!(w, "{line}")?;
        written += 1;
    }
    w.flush()?;
    drop(w);
    std::fs::rename(&tmp, &a.output)?;
    tracing::info!(
        "wrote {written} regenerated conversations to {} in {:.0} s",
        a.output.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Consecutive batches over prompts sorted by length (`lens`, ascending):
/// at most `batch_size` prompts and `max_tokens` padded tokens (prompts x
/// (longest + `new_tokens`)) each; a prompt too long for the token cap
/// alone still gets a batch of its own.
fn plan_batches(
    lens: &[usize],
    batch_size: usize,
    max_tokens: usize,
    new_tokens: usize,
) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < lens.len() {
        let mut end = start + 1;
        while end < lens.len()
            && end - start < batch_size.max(1)
            && (end + 1 - start) * (lens[end] + new_tokens) <= max_tokens
        {
            end += 1;
        }
        out.push(start..end);
        start = end;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::plan_batches;

    #[test]
    fn batches_cap_prompts_and_padded_tokens() {
        // Short prompts fill batches of 3; long ones pair up; the longest goes alone.
        let lens = [10, 10, 12, 14, 20, 400, 450, 3000];
        let b = plan_batches(&lens, 3, 1200, 96);
        assert_eq!(b, vec![0..3, 3..5, 5..7, 7..8]);
        for r in &b {
            let padded = r.len() * (lens[r.end - 1] + 96);
            assert!(r.len() == 1 || padded <= 1200, "{r:?}: {padded} padded tokens");
        }
        assert_eq!(b.iter().map(|r| r.len()).sum::<usize>(), lens.len());
        assert!(plan_batches(&[], 4, 100, 1).is_empty());
    }
}
