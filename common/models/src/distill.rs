//! Distillation targets (`training.loss = "kd"`): the target's `k` most
//! likely next tokens at every position with their log-probabilities. The
//! target computes them after its last layer and ships them after the
//! features (int32 ids, then float32 log-probabilities, `[T, k]` each); the
//! training step renormalizes them into the distribution each slot learns.
//!
//! Top-k and not the final hidden state: at k = 32 a position costs 256
//! bytes on the wire, against `2 * hidden_size` for a bf16 final state
//! (1,152 bytes for SmolLM2-135M, 8,192 for an 8B target), and the drafter
//! needs no second LM-head pass over its rows.

use tch::{Kind, Tensor};

/// The target's top-k next tokens, `[T, k]` each: ids (Int32 from the
/// target, Int64 on the drafter's device) and log-probabilities (Float).
/// Row t is the distribution of the token after position t.
pub struct TopK {
    pub ids: Tensor,
    pub log_probs: Tensor,
}

/// Logit entries computed at once (tokens per chunk x vocabulary): bounds
/// the f32 logits a chunk holds to 256 MiB.
pub const CHUNK_ENTRIES: i64 = 1 << 26;

impl TopK {
    /// From final normed hidden states `[T, H]` and the LM head `[V, H]`:
    /// logits in the model's kind (as the target's own forward computes
    /// them), log-softmax in f32 over the whole vocabulary, then the `k`
    /// largest, most likely first. Chunked over positions.
    pub fn of_hidden(hidden: &Tensor, lm_head: &Tensor, k: i64) -> Self {
        let _guard = tch::no_grad_guard();
        let (t, vocab) = (hidden.size()[0], lm_head.size()[0]);
        let per_chunk = (CHUNK_ENTRIES / vocab.max(1)).max(1);
        let (mut ids, mut log_probs) = (Vec::new(), Vec::new());
        let mut start = 0;
        while start < t {
            let len = per_chunk.min(t - start);
            let logits = hidden.narrow(0, start, len).linear(lm_head, None::<Tensor>);
            let (v, i) = logits.log_softmax(-1, Kind::Float).topk(k, -1, true, true);
            ids.push(i.to_kind(Kind::Int));
            log_probs.push(v);
            start += len;
        }
        Self { ids: Tensor::cat(&ids, 0), log_probs: Tensor::cat(&log_probs, 0) }
    }

    /// k.
    pub fn k(&self) -> i64 {
        self.ids.size()[1]
    }

    /// The two wire parts, in order and on their device: ids as int32,
    /// then log-probabilities as float32, each contiguous (no-ops for what
    /// [`TopK::of_hidden`] made).
    pub fn wire_parts(&self) -> [Tensor; 2] {
        [self.ids.to_kind(Kind::Int).contiguous(), self.log_probs.to_kind(Kind::Float).contiguous()]
    }

    /// Reads `[T, k]` ids and log-probabilities from their wire bytes onto
    /// `device` (ids as Int64, ready for gather and scatter).
    pub fn from_wire(bytes: &[u8], tokens: i64, k: i64, device: tch::Device) -> Result<Self, crate::ModelError> {
        let n = (tokens * k) as usize;
        if bytes.len() != n * 8 {
            return Err(crate::ModelError::Device(format!(
                "distillation targets: {} bytes for {tokens} positions x top-{k} (want {})",
                bytes.len(),
                n * 8
            )));
        }
        let (ids, lp) = bytes.split_at(n * 4);
        Ok(Self {
            ids: Tensor::f_from_data_size(ids, &[tokens, k], Kind::Int)?.to_device(device).to_kind(Kind::Int64),
            log_probs: Tensor::f_from_data_size(lp, &[tokens, k], Kind::Float)?.to_device(device),
        })
    }

    /// Positions `index` (`[M]`, Int64 on the same device) of both.
    pub fn rows(&self, index: &Tensor) -> Self {
        Self { ids: self.ids.index_select(0, index), log_probs: self.log_probs.index_select(0, index) }
    }
}
