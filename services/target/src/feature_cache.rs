//! Captured features of sequences a forward loop has already computed, kept
//! (up to a memory budget) so that later epochs, which revisit the same
//! sequences in new batches, skip the target forward. The features of a
//! sequence do not depend on the batch it was packed into (varlen attention),
//! so a batch assembled from the cache equals a fresh capture up to float
//! rounding (matmuls block by the batch's total length).
//!
//! Noise (`training.feature_noise_std`) is added after this stage, in
//! postprocessing, so every epoch still gets fresh noise.
//!
//! It holds per-token tensors (`[len, X]`, any kind): the captured layers,
//! and under distillation the target's top-k ids and log-probabilities
//! after them, as the forward loop hands them in.

use std::collections::HashMap;

use tch::Tensor;

/// Per-sample captured layers, bounded by bytes.
pub struct FeatureCache {
    budget: usize,
    used: usize,
    /// sample id -> one `[len, H]` tensor per captured layer.
    entries: HashMap<u64, Vec<Tensor>>,
    /// Sequences that did not fit (counted once each).
    refused: usize,
}

impl FeatureCache {
    /// A cache of at most `budget_bytes` (0: caches nothing).
    pub fn new(budget_bytes: usize) -> Self {
        Self { budget: budget_bytes, used: 0, entries: HashMap::new(), refused: 0 }
    }

    pub fn enabled(&self) -> bool {
        self.budget > 0
    }

    /// Bytes held.
    pub fn used_bytes(&self) -> usize {
        self.used
    }

    /// Sequences held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The batch's layers (`[T, H]` each, sequences in batch order) when
    /// every one of its sequences is cached; None otherwise.
    pub fn assemble(&self, sample_ids: &[u64]) -> Option<Vec<Tensor>> {
        let per_sample: Vec<&Vec<Tensor>> = sample_ids.iter().map(|id| self.entries.get(id)).collect::<Option<_>>()?;
        let layers = per_sample.first()?.len();
        Some(
            (0..layers)
                .map(|j| {
                    let parts: Vec<&Tensor> = per_sample.iter().map(|s| &s[j]).collect();
                    Tensor::cat(&parts, 0)
                })
                .collect(),
        )
    }

    /// Keeps the sequences of a computed batch that are not cached yet, while
    /// they fit. `layers` are the batch's packed captures, `seq_lengths` its
    /// sequences' lengths in order.
    pub fn insert(&mut self, sample_ids: &[u64], seq_lengths: &[u32], layers: &[Tensor]) {
        if !self.enabled() {
            return;
        }
        let mut offset = 0i64;
        for (&id, &len) in sample_ids.iter().zip(seq_lengths) {
            let len = i64::from(len);
            if !self.entries.contains_key(&id) {
                let bytes: usize =
                    layers.iter().map(|l| len as usize * l.size()[1] as usize * l.kind().elt_size_in_bytes()).sum();
                if self.used + bytes <= self.budget {
                    // A copy of its own: a slice would keep the whole batch alive.
                    let own = layers.iter().map(|l| l.narrow(0, offset, len).copy()).collect();
                    self.entries.insert(id, own);
                    self.used += bytes;
                } else {
                    self.refused += 1;
                    if self.refused == 1 {
                        tracing::warn!(
                            "feature cache full at {} MiB ({} sequences): later sequences are computed every epoch; \
                             raise pipeline.target_feature_cache_mib to keep them",
                            self.used >> 20,
                            self.entries.len()
                        );
                    }
                }
            }
            offset += len;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    fn batch(lens: &[i64], h: i64, seed: f64) -> Vec<Tensor> {
        let t: i64 = lens.iter().sum();
        (0..2).map(|j| Tensor::arange(t * h, (Kind::Float, Device::Cpu)).view([t, h]) * (seed + j as f64)).collect()
    }

    #[test]
    fn a_batch_assembled_from_cached_sequences_equals_their_capture_in_a_new_order() {
        let mut cache = FeatureCache::new(1 << 20);
        // Batch 1: samples 7 (3 tokens) and 9 (2 tokens).
        let b1 = batch(&[3, 2], 4, 1.0);
        cache.insert(&[7, 9], &[3, 2], &b1);
        assert_eq!(cache.len(), 2);
        assert_eq!(cache.used_bytes(), 2 * 5 * 4 * 4);
        assert!(cache.assemble(&[9, 8]).is_none(), "sample 8 was never computed");
        let got = cache.assemble(&[9, 7]).expect("both cached");
        for (j, l) in got.iter().enumerate() {
            let want = Tensor::cat(&[b1[j].narrow(0, 3, 2), b1[j].narrow(0, 0, 3)], 0);
            assert_eq!(l.size(), vec![5, 4]);
            assert!(l.equal(&want), "layer {j}");
        }
        // A cached sample is not replaced by a later capture.
        cache.insert(&[9], &[2], &batch(&[2], 4, 5.0));
        assert!(cache.assemble(&[9]).expect("cached")[0].equal(&b1[0].narrow(0, 3, 2)));
        assert_eq!(cache.len(), 2);
    }

    #[test]
    fn the_budget_bounds_what_is_kept_and_zero_keeps_nothing() {
        // Room for exactly one 3-token sequence of 2 layers x 4 floats.
        let mut cache = FeatureCache::new(3 * 4 * 4 * 2);
        cache.insert(&[1, 2], &[3, 3], &batch(&[3, 3], 4, 1.0));
        assert_eq!(cache.len(), 1);
        assert!(cache.assemble(&[1]).is_some());
        assert!(cache.assemble(&[2]).is_none());
        assert_eq!(cache.used_bytes(), 96);

        let mut off = FeatureCache::new(0);
        off.insert(&[1], &[3], &batch(&[3], 4, 1.0));
        assert_eq!(off.len(), 0);
        assert!(off.assemble(&[1]).is_none());
    }

    #[test]
    fn cached_sequences_own_their_memory() {
        let mut cache = FeatureCache::new(1 << 20);
        let b = batch(&[2, 2], 3, 1.0);
        cache.insert(&[1, 2], &[2, 2], &b);
        let before = cache.assemble(&[2]).expect("cached");
        // Writing into the batch's tensors must not change the cache.
        for l in &b {
            let mut l = l.shallow_clone();
            let _ = l.fill_(-1.0);
        }
        assert!(cache.assemble(&[2]).expect("cached")[0].equal(&before[0]));
        assert!(before[0].min().double_value(&[]) >= 0.0);
    }
}
