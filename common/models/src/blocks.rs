//! The DFlash training blocks: anchor sampling,
//! block inputs, the attention mask, and the loss labels and weights.

use rand::Rng;
use rand::seq::index::sample;
use tch::{Device, Kind, Tensor};

/// Settings of the block construction.
#[derive(Clone, Debug)]
pub struct BlockSettings {
    pub block_size: usize,
    pub mask_token_id: i64,
    pub gamma: f64,
    pub anchors_per_sequence: usize,
}

/// Valid anchor positions: `loss_mask[i] & loss_mask[i+1]`, `i < S-1`.
pub fn anchor_candidates(loss_mask: &[u8]) -> Vec<usize> {
    (0..loss_mask.len().saturating_sub(1)).filter(|&i| loss_mask[i] == 1 && loss_mask[i + 1] == 1).collect()
}

/// Up to `max` anchors drawn uniformly without replacement among the valid
/// positions, sorted.
pub fn sample_anchors(loss_mask: &[u8], max: usize, rng: &mut impl Rng) -> Vec<usize> {
    let cand = anchor_candidates(loss_mask);
    let n = max.min(cand.len());
    let mut picked: Vec<usize> = sample(rng, cand.len(), n).into_iter().map(|i| cand[i]).collect();
    picked.sort_unstable();
    picked
}

/// Loss weight of block slot `k` (1-based prediction slots; slot 0 is the
/// anchor and never counts): `exp(-(k-1)/gamma)`.
pub fn slot_weight(k: usize, gamma: f64) -> f64 {
    if k == 0 { 0.0 } else { (-((k - 1) as f64) / gamma).exp() }
}

/// One sequence of a micro-batch, as host data.
pub struct BlockSequence<'a> {
    pub input_ids: &'a [u32],
    pub loss_mask: &'a [u8],
    pub anchors: Vec<usize>,
}

/// Host-side description of a micro-batch: block tokens, positions, and the
/// supervised rows (slot >= 1 of every real block) with labels and weights.
pub struct BlockLayout {
    pub n: usize,
    /// Context length after padding (longest sequence).
    pub context_len: usize,
    /// Blocks per sequence after padding (a multiple of `chunk_blocks`).
    pub blocks: usize,
    /// Blocks whose queries share one attention call (with the context and
    /// their own slots as keys); `blocks / chunk_blocks` calls per sequence.
    pub chunk_blocks: usize,
    pub block_size: usize,
    /// `[n, blocks]` anchor positions (0 for padding blocks).
    pub anchors: Vec<i64>,
    /// `[n, blocks]` 1 for real blocks.
    pub valid: Vec<u8>,
    /// `[n, blocks * B]` block token ids.
    pub block_ids: Vec<i64>,
    /// `[n, blocks * B]` RoPE positions of block slots.
    pub block_positions: Vec<i64>,
    /// Flat indices into `[n * blocks * B]` of the supervised rows, grouped
    /// by block: B-1 consecutive rows per real block.
    pub rows: Vec<i64>,
    pub labels: Vec<i64>,
    pub weights: Vec<f32>,
    /// Per row: (sequence, position) whose next-token distribution the
    /// label is drawn from (the label's position - 1; the sequence's last
    /// position for a row past its end, which has weight 0). Distillation
    /// reads the target's top-k there.
    pub sources: Vec<(u32, u32)>,
    /// Real blocks (rows.len() / (B-1)).
    pub real_blocks: usize,
}

impl BlockLayout {
    /// Lays out the blocks of `seqs`, in attention chunks of at most
    /// `chunk_blocks` blocks.
    pub fn new(seqs: &[BlockSequence], s: &BlockSettings, chunk_blocks: usize) -> Self {
        let b = s.block_size;
        let n = seqs.len();
        let context_len = seqs.iter().map(|q| q.input_ids.len()).max().unwrap_or(0);
        let most = seqs.iter().map(|q| q.anchors.len()).max().unwrap_or(0).max(1);
        let chunk_blocks = chunk_blocks.clamp(1, most);
        let blocks = most.div_ceil(chunk_blocks) * chunk_blocks;
        let q_len = blocks * b;
        let mut l = BlockLayout {
            n,
            context_len,
            blocks,
            chunk_blocks,
            block_size: b,
            anchors: vec![0; n * blocks],
            valid: vec![0; n * blocks],
            block_ids: vec![s.mask_token_id; n * q_len],
            block_positions: vec![0; n * q_len],
            rows: Vec::new(),
            labels: Vec::new(),
            weights: Vec::new(),
            sources: Vec::new(),
            real_blocks: 0,
        };
        for (i, seq) in seqs.iter().enumerate() {
            let len = seq.input_ids.len();
            for j in 0..blocks {
                let base = i * q_len + j * b;
                let anchor = seq.anchors.get(j).copied();
                if let Some(a) = anchor {
                    l.anchors[i * blocks + j] = a as i64;
                    l.valid[i * blocks + j] = 1;
                    l.block_ids[base] = seq.input_ids[a] as i64;
                    l.real_blocks += 1;
                }
                let a = anchor.unwrap_or(0);
                for k in 0..b {
                    l.block_positions[base + k] = (a + k) as i64;
                }
                if anchor.is_none() {
                    continue;
                }
                for k in 1..b {
                    let pos = a + k;
                    let in_range = pos < len;
                    let w = if in_range && seq.loss_mask[pos] == 1 { slot_weight(k, s.gamma) } else { 0.0 };
                    l.rows.push((base + k) as i64);
                    l.labels.push(if in_range { seq.input_ids[pos] as i64 } else { 0 });
                    l.weights.push(w as f32);
                    l.sources.push((i as u32, (pos.min(len) - 1) as u32));
                }
            }
        }
        l
    }

    /// Rounds the context length up to a multiple of `m`. The extra keys
    /// are zero features after every anchor, so the mask hides them from
    /// every query and the result is unchanged; what changes is that
    /// batches of nearby lengths share one attention shape.
    pub fn with_context_multiple(mut self, m: usize) -> Self {
        self.context_len = self.context_len.div_ceil(m.max(1)) * m.max(1);
        self
    }

    /// Each supervised row's true predecessor: the anchor token for a
    /// block's first drafted slot, the data token before it for the others
    /// (what DFlash2's selector conditions on when every earlier pick was right).
    pub fn predecessors(&self) -> Vec<i64> {
        let per_block = self.block_size - 1;
        (0..self.rows.len())
            .map(|r| if r % per_block == 0 { self.block_ids[self.rows[r] as usize - 1] } else { self.labels[r - 1] })
            .collect()
    }

    pub fn total_weight(&self) -> f64 {
        self.weights.iter().map(|&w| w as f64).sum()
    }

    /// Slots with a label to learn (weight > 0).
    pub fn supervised_slots(&self) -> usize {
        self.weights.iter().filter(|&&w| w > 0.0).count()
    }

    /// The attention mask `[n * G, 1, C*B, S + C*B]` for G = blocks / C
    /// chunks of C blocks: a query of block j sees context positions
    /// strictly before its anchor and every slot of its own block, nothing
    /// else. Keys of a chunk are the context followed by the chunk's slots.
    pub fn attention_mask(&self, device: Device) -> Tensor {
        let (n, b, s) = (self.n as i64, self.block_size as i64, self.context_len as i64);
        let (g, cb) = self.chunks();
        let q_block = Tensor::arange(cb, (Kind::Int64, device)).divide_scalar_mode(b, "floor"); // [CB]
        let anchor_of_q = self.anchor_of_queries(device); // [n, G, CB]
        let ctx_pos = Tensor::arange(s, (Kind::Int64, device));
        let sees_ctx = ctx_pos.view([1, 1, 1, s]).lt_tensor(&anchor_of_q.unsqueeze(-1)); // [n, G, CB, S]
        let sees_block = q_block.unsqueeze(1).eq_tensor(&q_block.unsqueeze(0)); // [CB, CB]
        Tensor::cat(&[sees_ctx, sees_block.view([1, 1, cb, cb]).expand([n, g, cb, cb], false)], -1).view([
            n * g,
            1,
            cb,
            s + cb,
        ])
    }
}

impl BlockLayout {
    /// Attention chunks and query slots per chunk: (G, C*B).
    fn chunks(&self) -> (i64, i64) {
        let c = self.chunk_blocks as i64;
        (self.blocks as i64 / c, c * self.block_size as i64)
    }

    /// The anchor of every query slot, `[n, G, C*B]`.
    fn anchor_of_queries(&self, device: Device) -> Tensor {
        let (g, cb) = self.chunks();
        let anchors = Tensor::from_slice(&self.anchors).view([self.n as i64, g, self.chunk_blocks as i64]);
        let q_block = Tensor::arange(cb, (Kind::Int64, device)).divide_scalar_mode(self.block_size as i64, "floor");
        anchors.to_device(device).index_select(2, &q_block)
    }

    /// The mask of a sliding-attention layer, laid out as
    /// [`BlockLayout::attention_mask`]: that mask, further bounded so that
    /// the slot at position p (anchor + slot) sees only keys at positions
    /// p - window < k <= p -- the context within the window and the
    /// earlier slots of its own block, itself included (causal) -- what the
    /// `dflash` package applies when it decodes.
    pub fn sliding_attention_mask(&self, device: Device, window: i64) -> Tensor {
        let (n, b, s) = (self.n as i64, self.block_size as i64, self.context_len as i64);
        let (g, cb) = self.chunks();
        let slot = Tensor::arange(cb, (Kind::Int64, device)).remainder(b); // [CB]
        let q_pos = self.anchor_of_queries(device) + slot; // [n, G, CB]
        let ctx_pos = Tensor::arange(s, (Kind::Int64, device)).view([1, 1, s]).expand([n, g, s], false);
        let k_pos = Tensor::cat(&[ctx_pos, q_pos.shallow_clone()], -1); // [n, G, S + CB]
        let back = q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2); // [n, G, CB, S + CB]
        let within = back.ge(0).logical_and(&back.lt(window)).view([n * g, 1, cb, s + cb]);
        self.attention_mask(device).logical_and(&within)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn anchors_need_two_trainable_tokens_and_are_sorted() {
        let mask = [0, 1, 1, 1, 0, 1, 1, 0];
        assert_eq!(anchor_candidates(&mask), vec![1, 2, 5]);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
        let a = sample_anchors(&mask, 2, &mut rng);
        assert_eq!(a.len(), 2);
        assert!(a.windows(2).all(|w| w[0] < w[1]));
        assert!(a.iter().all(|x| [1, 2, 5].contains(x)));
        assert_eq!(sample_anchors(&mask, 10, &mut rng), vec![1, 2, 5]);
    }

    fn settings(b: usize) -> BlockSettings {
        BlockSettings { block_size: b, mask_token_id: 99, gamma: 4.0, anchors_per_sequence: 8 }
    }

    #[test]
    fn a_block_sees_strictly_earlier_context_and_its_own_block_only() {
        let ids: Vec<u32> = (10..20).collect();
        let mask = vec![1u8; 10];
        let seqs = [BlockSequence { input_ids: &ids, loss_mask: &mask, anchors: vec![2, 6] }];
        let l = BlockLayout::new(&seqs, &settings(3), 8);
        let m = l.attention_mask(Device::Cpu); // [1, 1, 6, 10 + 6]
        assert_eq!(m.size(), vec![1, 1, 6, 16]);
        let sees = |q: i64, kv: i64| m.int64_value(&[0, 0, q, kv]) == 1;
        for q in 0..6 {
            let (block, anchor) = if q < 3 { (0, 2) } else { (1, 6) };
            for kv in 0..10 {
                assert_eq!(sees(q, kv), kv < anchor, "query {q} context {kv}");
            }
            for kv in 0..6 {
                assert_eq!(sees(q, 10 + kv), kv / 3 == block, "query {q} block slot {kv}");
            }
        }
        // The anchor's own feature is invisible (strict <): the classic bug.
        assert!(!sees(0, 2));
    }

    #[test]
    fn a_sliding_layer_sees_its_window_causally() {
        let ids: Vec<u32> = (10..30).collect();
        let mask = vec![1u8; 20];
        let seqs = [BlockSequence { input_ids: &ids, loss_mask: &mask, anchors: vec![4, 13] }];
        let l = BlockLayout::new(&seqs, &settings(3), 8);
        let window = 5;
        let m = l.sliding_attention_mask(Device::Cpu, window); // [1, 1, 6, 20 + 6]
        assert_eq!(m.size(), vec![1, 1, 6, 26]);
        let sees = |q: i64, kv: i64| m.int64_value(&[0, 0, q, kv]) == 1;
        for q in 0..6 {
            let (block, anchor, slot) = if q < 3 { (0, 4, q) } else { (1, 13, q - 3) };
            let pos = anchor + slot;
            for kv in 0..20 {
                assert_eq!(sees(q, kv), kv < anchor && pos - kv < window, "query {q} context {kv}");
            }
            for kv in 0..6 {
                let (kb, ks) = (kv / 3, kv % 3);
                assert_eq!(sees(q, 20 + kv), kb == block && ks <= slot && slot - ks < window, "query {q} slot {kv}");
            }
        }
    }

    #[test]
    fn labels_are_the_tokens_after_the_anchor_weighted_by_slot() {
        let ids: Vec<u32> = (10..20).collect();
        let mut mask = vec![1u8; 10];
        mask[5] = 0;
        let seqs = [BlockSequence { input_ids: &ids, loss_mask: &mask, anchors: vec![3, 8] }];
        let l = BlockLayout::new(&seqs, &settings(3), 8);
        assert_eq!(l.block_ids, vec![13, 99, 99, 18, 99, 99]);
        assert_eq!(l.block_positions, vec![3, 4, 5, 8, 9, 10]);
        // slot k of anchor a predicts ids[a + k] (no off-by-one)
        assert_eq!(l.rows, vec![1, 2, 4, 5]);
        assert_eq!(l.labels, vec![14, 15, 19, 0]);
        let w1 = 1.0f32;
        let w2 = (-1.0f64 / 4.0).exp() as f32;
        // ids[5] is masked out; position 10 is past the end
        assert_eq!(l.weights, vec![w1, 0.0, w1, 0.0]);
        assert_eq!(slot_weight(2, 4.0) as f32, w2);
        assert_eq!(slot_weight(0, 4.0), 0.0);
    }

    #[test]
    fn chunks_keep_the_same_visibility_with_fewer_keys() {
        let ids: Vec<u32> = (0..12).collect();
        let mask = vec![1u8; 12];
        let seqs = [BlockSequence { input_ids: &ids, loss_mask: &mask, anchors: vec![1, 4, 6, 9] }];
        let l = BlockLayout::new(&seqs, &settings(2), 2); // 2 chunks of 2 blocks
        let m = l.attention_mask(Device::Cpu);
        assert_eq!(m.size(), vec![2, 1, 4, 12 + 4]);
        let anchors = [1, 4, 6, 9];
        for chunk in 0..2i64 {
            for q in 0..4i64 {
                let block = chunk * 2 + q / 2;
                for kv in 0..12 {
                    let want = kv < anchors[block as usize];
                    assert_eq!(m.int64_value(&[chunk, 0, q, kv]) == 1, want, "chunk {chunk} query {q} ctx {kv}");
                }
                for kv in 0..4 {
                    assert_eq!(m.int64_value(&[chunk, 0, q, 12 + kv]) == 1, kv / 2 == q / 2);
                }
            }
        }
        // Padding rounds the blocks up to whole chunks.
        let seqs = [BlockSequence { input_ids: &ids, loss_mask: &mask, anchors: vec![1, 4, 6] }];
        let l = BlockLayout::new(&seqs, &settings(2), 2);
        assert_eq!((l.blocks, l.real_blocks), (4, 3));
    }

    #[test]
    fn padding_blocks_have_no_rows_and_see_only_themselves() {
        let a: Vec<u32> = (0..8).collect();
        let b: Vec<u32> = (0..4).collect();
        let (ma, mb) = (vec![1u8; 8], vec![1u8; 4]);
        let seqs = [
            BlockSequence { input_ids: &a, loss_mask: &ma, anchors: vec![1, 3, 5] },
            BlockSequence { input_ids: &b, loss_mask: &mb, anchors: vec![1] },
        ];
        let l = BlockLayout::new(&seqs, &settings(2), 8);
        assert_eq!((l.blocks, l.real_blocks), (3, 4));
        assert_eq!(l.rows.len(), 4);
        let m = l.attention_mask(Device::Cpu);
        // sequence 1, padding block 2 (queries 4, 5): no context, its own slots
        assert_eq!(m.size(), vec![2, 1, 6, 8 + 6]);
        let row: Vec<i64> = (0..8 + 6).map(|kv| m.int64_value(&[1, 0, 4, kv])).collect();
        assert_eq!(row, vec![0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1]);
    }
}
