//! The data order: which samples form which batch, deterministic from the
//! seed and the epoch.

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

/// One batch of an epoch plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedBatch {
    /// `(epoch << 32) | index`: unique in a run and readable.
    pub batch_id: u64,
    pub epoch: u32,
    pub sample_ids: Vec<u64>,
    pub sample_lengths: Vec<u32>,
}

impl PlannedBatch {
    pub fn tokens(&self) -> u64 {
        self.sample_lengths.iter().map(|&l| l as u64).sum()
    }
}

/// Batch id of the `index`-th batch of `epoch`.
pub fn batch_id(epoch: u32, index: u32) -> u64 {
    ((epoch as u64) << 32) | index as u64
}

/// Shuffles `(sample id, length)` pairs with a generator seeded by
/// `(seed, epoch)` and packs them in that order into batches of at most
/// `token_budget` tokens and `max_batch_size` sequences.
pub fn plan_epoch(
    samples: &[(u64, u32)],
    seed: u64,
    epoch: u32,
    token_budget: u32,
    max_batch_size: u32,
) -> Vec<PlannedBatch> {
    let mut order: Vec<(u64, u32)> = samples.to_vec();
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (epoch as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    order.shuffle(&mut rng);
    let mut batches: Vec<PlannedBatch> = Vec::new();
    let mut cur = PlannedBatch { batch_id: 0, epoch, sample_ids: Vec::new(), sample_lengths: Vec::new() };
    let mut cur_tokens = 0u64;
    for (id, len) in order {
        let len = len.min(token_budget);
        let full = cur.sample_ids.len() as u32 >= max_batch_size || cur_tokens + len as u64 > token_budget as u64;
        if full && !cur.sample_ids.is_empty() {
            cur.batch_id = batch_id(epoch, batches.len() as u32);
            batches.push(std::mem::replace(
                &mut cur,
                PlannedBatch { batch_id: 0, epoch, sample_ids: Vec::new(), sample_lengths: Vec::new() },
            ));
            cur_tokens = 0;
        }
        cur.sample_ids.push(id);
        cur.sample_lengths.push(len);
        cur_tokens += len as u64;
    }
    if !cur.sample_ids.is_empty() {
        cur.batch_id = batch_id(epoch, batches.len() as u32);
        batches.push(cur);
    }
    batches
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples() -> Vec<(u64, u32)> {
        (0..100).map(|i| (i, 10 + (i as u32 * 7) % 50)).collect()
    }

    #[test]
    fn every_sample_once_within_budget() {
        let plan = plan_epoch(&samples(), 3, 0, 120, 4);
        let mut seen: Vec<u64> = plan.iter().flat_map(|b| b.sample_ids.clone()).collect();
        seen.sort();
        assert_eq!(seen, (0..100).collect::<Vec<_>>());
        for b in &plan {
            assert!(b.tokens() <= 120 && b.sample_ids.len() <= 4, "{b:?}");
        }
    }

    #[test]
    fn deterministic_per_seed_and_epoch() {
        assert_eq!(plan_epoch(&samples(), 3, 1, 120, 4), plan_epoch(&samples(), 3, 1, 120, 4));
        assert_ne!(plan_epoch(&samples(), 3, 1, 120, 4), plan_epoch(&samples(), 3, 2, 120, 4));
        let p = plan_epoch(&samples(), 3, 2, 120, 4);
        assert_eq!(p[1].batch_id, (2u64 << 32) | 1);
    }
}
