//! Decoding with the target: batched greedy generation with a KV cache (for
//! regenerating training data) and greedy speculative decoding with a
//! DFlash drafter, which measures the real
//! acceptance length.

use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};

use crate::drafter::{BlockAttention, Drafter, DrafterInput};
use crate::kv_cache::KvCache;
use crate::target::TargetModel;

/// Greedy continuations of `prompts` (token ids), generated together with
/// left padding. Each output stops after a stop id (included) or at
/// `max_new_tokens`.
pub fn greedy_generate(
    target: &TargetModel,
    prompts: &[Vec<u32>],
    max_new_tokens: usize,
    stop_ids: &[u32],
) -> Vec<Vec<u32>> {
    let _guard = tch::no_grad_guard();
    let dev = target.device;
    let b = prompts.len() as i64;
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0) as i64;
    if b == 0 || longest == 0 {
        return vec![Vec::new(); prompts.len()];
    }
    let mut ids = vec![0i64; (b * longest) as usize];
    let mut valid = vec![false; (b * longest) as usize];
    for (i, p) in prompts.iter().enumerate() {
        let pad = longest as usize - p.len();
        for (j, &t) in p.iter().enumerate() {
            ids[i * longest as usize + pad + j] = t as i64;
            valid[i * longest as usize + pad + j] = true;
        }
    }
    let ids = Tensor::from_slice(&ids).view([b, longest]).to_device(dev);
    let mut key_valid = Tensor::from_slice(&valid).view([b, longest]).to_device(dev);
    let positions = (key_valid.to_kind(Kind::Int64).cumsum(1, Kind::Int64) - 1).clamp_min(0);
    let mut next_pos = positions.select(1, longest - 1).unsqueeze(1) + 1;
    let mut cache = target.new_cache(b);
    let (hidden, _) = target.forward_cached(&ids, &positions, &key_valid, &mut cache, &[]);
    let mut next = target.logits(&hidden.select(1, longest - 1)).argmax(-1, false); // [B]
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    // Rows still decoding, as indices into `prompts`; finished rows leave
    // the batch (and the cache) so no compute is spent on them.
    let mut live: Vec<usize> = (0..prompts.len()).collect();
    for step in 0..max_new_tokens {
        let toks = Vec::<i64>::try_from(&next).expect("1-D token ids");
        let mut keep = Vec::with_capacity(live.len());
        for (row, (&i, &t)) in live.iter().zip(&toks).enumerate() {
            out[i].push(t as u32);
            if !stop_ids.contains(&(t as u32)) {
                keep.push(row as i64);
            }
        }
        if keep.is_empty() || step + 1 == max_new_tokens {
            break;
        }
        if keep.len() < live.len() {
            let rows = Tensor::from_slice(&keep).to_device(dev);
            cache.retain_rows(&rows);
            key_valid = key_valid.index_select(0, &rows);
            next_pos = next_pos.index_select(0, &rows);
            next = next.index_select(0, &rows);
            live = keep.iter().map(|&r| live[r as usize]).collect();
        }
        let n = live.len() as i64;
        key_valid = Tensor::cat(&[&key_valid, &Tensor::ones([n, 1], (Kind::Bool, dev))], 1);
        let (hidden, _) = target.forward_cached(&next.unsqueeze(1), &next_pos, &key_valid, &mut cache, &[]);
        next_pos += 1;
        next = target.logits(&hidden.select(1, 0)).argmax(-1, false);
    }
    out
}

/// One prompt's speculative decoding.
#[derive(Clone, Debug)]
pub struct SpecResult {
    /// Generated tokens (identical to greedy decoding by construction).
    pub tokens: Vec<u32>,
    /// Tokens produced by each target verify step (accepted + bonus).
    pub per_step: Vec<u32>,
    /// What each verify step saw: the anchor's absolute position (prompt
    /// included), the drafter's proposals and how many the target accepted.
    pub steps: Vec<SpecStep>,
    pub elapsed: Duration,
}

/// One draft-and-verify step of speculative decoding.
#[derive(Clone, Debug)]
pub struct SpecStep {
    pub anchor: usize,
    pub proposal: Vec<u32>,
    pub accepted: u32,
}

impl SpecResult {
    /// Acceptance length tau: tokens per target verify step.
    pub fn tau(&self) -> f64 {
        if self.per_step.is_empty() {
            return 0.0;
        }
        self.per_step.iter().map(|&n| n as f64).sum::<f64>() / self.per_step.len() as f64
    }
}

/// What speculative decoding needs besides the two models.
pub struct SpecSettings<'a> {
    /// The target's `[vocab, H]` embedding and LM head on the drafter's device.
    pub embed: &'a Tensor,
    pub lm_head: &'a Tensor,
    pub max_new_tokens: usize,
    pub stop_ids: &'a [u32],
}

/// The drafter's final hidden states `[1, block - 1, H]` and logits
/// `[1, block - 1, vocab]` of the drafted slots of the block after `context`
/// (`[1, S, k*H]`, the target's features of every token before `last`):
/// block `[last, MASK...]` at positions `S..` sees the whole context.
fn draft_block(drafter: &Drafter, context: &Tensor, last: i64, s: &SpecSettings) -> (Tensor, Tensor) {
    let c = &drafter.config;
    let (bsz, ddev) = (c.block_size, drafter.device());
    let ctx_len = context.size()[1];
    let mut block = vec![c.mask_token_id; bsz as usize];
    block[0] = last;
    let block_t = Tensor::from_slice(&block).view([1, bsz]).to_device(ddev);
    let embeds = Tensor::embedding(s.embed, &block_t, -1, false, false);
    let positions = (Tensor::arange(bsz, (Kind::Int64, ddev)) + ctx_len).unsqueeze(0);
    let full = Tensor::ones([1, 1, bsz, ctx_len + bsz], (Kind::Bool, ddev));
    // A sliding layer's slot at position p sees keys p - window < k <= p.
    let sliding = c.window().map(|w| {
        let q_pos = positions.view([bsz, 1]);
        let k_pos = Tensor::arange(ctx_len + bsz, (Kind::Int64, ddev)).view([1, ctx_len + bsz]);
        let back = q_pos - k_pos;
        back.ge(0).logical_and(&back.lt(w)).view([1, 1, bsz, ctx_len + bsz])
    });
    let h = drafter.forward(&DrafterInput {
        features: context,
        block_embeds: &embeds,
        block_positions: &positions,
        attention: BlockAttention::Masked { full: &full, sliding: sliding.as_ref() },
    });
    let drafted = h.narrow(1, 1, bsz - 1);
    let logits = drafted.linear(s.lm_head, None::<Tensor>);
    (drafted, logits)
}

/// The drafter's logits `[block - 1, vocab]` (f32, on the CPU) for the
/// first block speculative decoding of `prompt` drafts: after the prompt,
/// anchored at the target's first greedy token. What a client of the
/// exported drafter (the `dflash` package, vLLM, SGLang) must reproduce.
pub fn first_block_logits(target: &TargetModel, drafter: &Drafter, prompt: &[u32], s: &SpecSettings) -> Tensor {
    let _guard = tch::no_grad_guard();
    let (_, context, last) = prefill(target, drafter, prompt);
    host_logits(drafter, &context, last, s)
}

/// The drafter's logits `[block - 1, vocab]` (f32, on the CPU) for the
/// block decoding would draft after `prefix` if the token at the anchor
/// were `anchor` (whatever the target's greedy choice): how a sequence
/// that is not greedy's is drafted, block by block.
pub fn block_logits_at(
    target: &TargetModel,
    drafter: &Drafter,
    prefix: &[u32],
    anchor: u32,
    s: &SpecSettings,
) -> Tensor {
    let _guard = tch::no_grad_guard();
    let (_, context, _) = prefill(target, drafter, prefix);
    host_logits(drafter, &context, i64::from(anchor), s)
}

fn host_logits(drafter: &Drafter, context: &Tensor, anchor: i64, s: &SpecSettings) -> Tensor {
    draft_block(drafter, context, anchor, s).1.squeeze_dim(0).to_kind(Kind::Float).to_device(Device::Cpu)
}

/// The target's forward over `prompt`: its cache, the drafter's context
/// `[1, S, k*H]` (features of the captured layers, in the drafter's kind
/// and device) and the first greedy token.
fn prefill(target: &TargetModel, drafter: &Drafter, prompt: &[u32]) -> (KvCache, Tensor, i64) {
    let dev = target.device;
    let layers: Vec<i64> = drafter.config.target_layer_ids.clone();
    let ids: Vec<i64> = prompt.iter().map(|&t| t as i64).collect();
    let n = ids.len() as i64;
    let mut cache = target.new_cache(1);
    let ids_t = Tensor::from_slice(&ids).view([1, n]).to_device(dev);
    let pos = Tensor::arange(n, (Kind::Int64, dev)).unsqueeze(0);
    let (hidden, feats) =
        target.forward_cached(&ids_t, &pos, &Tensor::ones([1, n], (Kind::Bool, dev)), &mut cache, &layers);
    let context = Tensor::cat(&feats, -1).to_device(drafter.device()).to_kind(drafter.kind());
    let last = target.logits(&hidden.select(1, n - 1)).argmax(-1, false).int64_value(&[0]);
    (cache, context, last)
}

/// Greedy speculative decoding of one prompt: the drafter proposes a block
/// from the target's features of everything before the last token, the
/// target verifies the block in one forward, the longest matching prefix
/// plus the target's bonus token is kept, and the cache and features roll
/// forward by exactly the accepted tokens.
pub fn speculative_generate(target: &TargetModel, drafter: &Drafter, prompt: &[u32], s: &SpecSettings) -> SpecResult {
    let _guard = tch::no_grad_guard();
    let started = Instant::now();
    let dev = target.device;
    let c = &drafter.config;
    let bsz = c.block_size;
    let layers: Vec<i64> = c.target_layer_ids.clone();
    let kind = drafter.kind();
    let (mut cache, mut context, mut last) = prefill(target, drafter, prompt);
    let mut out = vec![last as u32];
    let mut per_step = Vec::new();
    let mut steps = Vec::new();
    let ddev = drafter.device();
    while out.len() < s.max_new_tokens && !s.stop_ids.contains(&(last as u32)) {
        let ctx_len = context.size()[1];
        let (drafted, logits) = draft_block(drafter, &context, last, s);
        let anchor = Tensor::from_slice(&[last]).to_device(ddev);
        let proposal = drafter.propose(&drafted, &logits, &anchor).view([-1]);
        let proposal = Vec::<i64>::try_from(&proposal.to_device(Device::Cpu)).expect("1-D");
        // Verify: the target reads [last, proposal...] in one forward.
        let mut verify = vec![last];
        verify.extend_from_slice(&proposal);
        let past = cache.len();
        let v_t = Tensor::from_slice(&verify).view([1, bsz]).to_device(dev);
        let v_pos = (Tensor::arange(bsz, (Kind::Int64, dev)) + past).unsqueeze(0);
        let valid = Tensor::ones([1, past + bsz], (Kind::Bool, dev));
        let (vh, vfeats) = target.forward_cached(&v_t, &v_pos, &valid, &mut cache, &layers);
        let target_next =
            Vec::<i64>::try_from(&target.logits(&vh.squeeze_dim(0)).argmax(-1, false).to_device(Device::Cpu))
                .expect("1-D");
        let mut accepted = 0usize;
        while accepted < proposal.len() && proposal[accepted] == target_next[accepted] {
            accepted += 1;
        }
        // Keep last + accepted proposals in the cache and the context.
        let keep = accepted as i64 + 1;
        cache.truncate(past + keep);
        let new_feats = Tensor::cat(&vfeats, -1).narrow(1, 0, keep).to_device(ddev).to_kind(kind);
        context = Tensor::cat(&[&context, &new_feats], 1);
        let mut produced = 0u32;
        for &t in proposal.iter().take(accepted).chain(std::iter::once(&target_next[accepted])) {
            if out.len() >= s.max_new_tokens {
                break;
            }
            out.push(t as u32);
            produced += 1;
            last = t;
            if s.stop_ids.contains(&(t as u32)) {
                break;
            }
        }
        per_step.push(produced);
        steps.push(SpecStep {
            anchor: ctx_len as usize,
            proposal: proposal.iter().map(|&t| t as u32).collect(),
            accepted: accepted as u32,
        });
    }
    SpecResult { tokens: out, per_step, steps, elapsed: started.elapsed() }
}
