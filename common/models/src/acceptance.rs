//! Simulated acceptance on one sequence, computed the way the training step
//! sees it (the block layout, its mask and the packed target features), so
//! that it can be set against what real speculative decoding accepts at the
//! same anchors. A mismatch between the two is a train/inference bug; a
//! match says the gap between simulated and real tau is where decoding
//! spends its steps.

use tch::{Device, Kind, Tensor};

use crate::blocks::{BlockLayout, BlockSequence, BlockSettings};
use crate::drafter::Drafter;
use crate::target::TargetModel;

/// Anchors per attention chunk of the no-grad forward (bounds memory on
/// long sequences; chunking is exact).
const CHUNK_BLOCKS: usize = 64;

/// The drafter's proposals at each anchor of one sequence.
pub struct BlockPredictions {
    pub anchors: Vec<usize>,
    /// `anchors.len() x (B-1)` proposed tokens of slots 1..B-1 (what
    /// decoding would propose there: [`Drafter::propose`]).
    pub proposals: Vec<Vec<u32>>,
    /// `anchors.len() x (B-1)` log-probabilities the drafter's block logits
    /// give the sequence's token at each slot (in f32 from the logits'
    /// kind; NaN past the end of the sequence).
    pub label_log_probs: Vec<Vec<f32>>,
}

/// Per-slot scores of the drafted slots whose data token is in the loss
/// mask: the block objective's cross-entropy without slot weights, and how
/// often the proposal is the data token.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SlotScores {
    pub slots: u64,
    pub cross_entropy_sum: f64,
    pub correct: u64,
}

impl SlotScores {
    pub fn add(&mut self, other: SlotScores) {
        self.slots += other.slots;
        self.cross_entropy_sum += other.cross_entropy_sum;
        self.correct += other.correct;
    }

    /// Mean cross-entropy per slot (nats) and accuracy; None without slots.
    pub fn means(&self) -> Option<(f64, f64)> {
        (self.slots > 0).then(|| (self.cross_entropy_sum / self.slots as f64, self.correct as f64 / self.slots as f64))
    }
}

impl BlockPredictions {
    /// Scores every drafted slot of `anchors` (indices into [`Self::anchors`])
    /// whose position is inside the sequence and the loss mask.
    pub fn slot_scores(&self, input_ids: &[u32], loss_mask: &[u8], anchors: &[usize]) -> SlotScores {
        let mut s = SlotScores::default();
        for &i in anchors {
            let a = self.anchors[i];
            for (k, (&t, &lp)) in self.proposals[i].iter().zip(&self.label_log_probs[i]).enumerate() {
                let pos = a + k + 1;
                if supervised(pos, input_ids, loss_mask) {
                    s.slots += 1;
                    s.cross_entropy_sum -= f64::from(lp);
                    s.correct += u64::from(input_ids[pos] == t);
                }
            }
        }
        s
    }

    /// Leading proposals equal to the data tokens at each anchor (slots past
    /// the end of the sequence or outside the loss mask stop the count).
    pub fn accepted(&self, input_ids: &[u32], loss_mask: &[u8]) -> Vec<u32> {
        self.anchors
            .iter()
            .zip(&self.proposals)
            .map(|(&a, prop)| {
                prop.iter()
                    .enumerate()
                    .take_while(|&(i, &t)| {
                        let pos = a + i + 1;
                        supervised(pos, input_ids, loss_mask) && input_ids[pos] == t
                    })
                    .count() as u32
            })
            .collect()
    }
}

/// Whether position `pos` holds a data token the drafter is scored on:
/// inside the sequence and the loss mask.
fn supervised(pos: usize, input_ids: &[u32], loss_mask: &[u8]) -> bool {
    pos < input_ids.len() && loss_mask[pos] == 1
}

/// Proposals of `drafter` at `anchors` of the sequence `input_ids`, from
/// the target's packed features of the whole sequence and the training
/// step's block layout.
pub fn block_predictions(
    target: &TargetModel,
    drafter: &Drafter,
    embed: &Tensor,
    lm_head: &Tensor,
    input_ids: &[u32],
    loss_mask: &[u8],
    anchors: &[usize],
) -> BlockPredictions {
    let _guard = tch::no_grad_guard();
    let c = &drafter.config;
    let (ddev, kind) = (drafter.device(), drafter.kind());
    if anchors.is_empty() {
        return BlockPredictions { anchors: Vec::new(), proposals: Vec::new(), label_log_probs: Vec::new() };
    }
    let ids: Vec<i64> = input_ids.iter().map(|&t| t as i64).collect();
    let ids_t = Tensor::from_slice(&ids).to_device(target.device);
    let feats = target.capture_packed(&ids_t, &[ids.len() as i64], &c.target_layer_ids);
    let features = Tensor::cat(&feats, -1).to_device(ddev).to_kind(kind).unsqueeze(0); // [1, S, kH]
    let settings = BlockSettings {
        block_size: c.block_size as usize,
        mask_token_id: c.mask_token_id,
        gamma: 1.0,
        anchors_per_sequence: anchors.len(),
    };
    let seq = BlockSequence { input_ids, loss_mask, anchors: anchors.to_vec() };
    let layout = BlockLayout::new(std::slice::from_ref(&seq), &settings, CHUNK_BLOCKS);
    let hidden = drafter.forward_layout(&features, embed, &layout);
    let b = c.block_size;
    let drafted = hidden.view([layout.blocks as i64, b, -1]).narrow(0, 0, anchors.len() as i64).narrow(1, 1, b - 1);
    let logits = drafted.linear(lm_head, None::<Tensor>);
    let anchor_ids: Vec<i64> = anchors.iter().map(|&a| input_ids[a] as i64).collect();
    let argmax = drafter
        .propose(&drafted, &logits, &Tensor::from_slice(&anchor_ids).to_device(ddev))
        .to_device(Device::Cpu)
        .to_kind(Kind::Int64);
    let flat = Vec::<i64>::try_from(argmax.view([-1])).expect("1-D token ids");
    let proposals = flat.chunks(b as usize - 1).map(|r| r.iter().map(|&t| t as u32).collect()).collect();
    let label_log_probs = label_log_probs(&logits, input_ids, anchors);
    BlockPredictions { anchors: anchors.to_vec(), proposals, label_log_probs }
}

/// Log-probabilities of the sequence's tokens under `logits`
/// (`[anchors, B-1, vocab]`), a chunk of anchors at a time: the softmax's
/// normaliser needs a vocab-sized temporary per slot, which at a large
/// vocabulary and hundreds of anchors would double the logits' memory.
fn label_log_probs(logits: &Tensor, input_ids: &[u32], anchors: &[usize]) -> Vec<Vec<f32>> {
    let slots = logits.size()[1] as usize;
    let dev = logits.device();
    let mut out = Vec::with_capacity(anchors.len());
    for (c, chunk) in anchors.chunks(CHUNK_BLOCKS).enumerate() {
        // Positions past the end take token 0 and come back as NaN.
        let labels: Vec<i64> = chunk
            .iter()
            .flat_map(|&a| (1..=slots).map(move |k| input_ids.get(a + k).map_or(0, |&t| i64::from(t))))
            .collect();
        let labels = Tensor::from_slice(&labels).view([chunk.len() as i64, slots as i64, 1]).to_device(dev);
        let part = logits.narrow(0, (c * CHUNK_BLOCKS) as i64, chunk.len() as i64).to_kind(Kind::Float);
        let lp = part.gather(-1, &labels, false).squeeze_dim(-1) - part.logsumexp([-1], false);
        let flat = Vec::<f32>::try_from(lp.to_device(Device::Cpu).view([-1])).expect("1-D log-probabilities");
        for (row, &a) in flat.chunks(slots).zip(chunk) {
            out.push(
                row.iter().enumerate().map(|(k, &v)| if a + k + 1 < input_ids.len() { v } else { f32::NAN }).collect(),
            );
        }
    }
    out
}
