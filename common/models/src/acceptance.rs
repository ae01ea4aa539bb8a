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
}

impl BlockPredictions {
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
                        pos < input_ids.len() && loss_mask[pos] == 1 && input_ids[pos] == t
                    })
                    .count() as u32
            })
            .collect()
    }
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
        return BlockPredictions { anchors: Vec::new(), proposals: Vec::new() };
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
    BlockPredictions { anchors: anchors.to_vec(), proposals }
}
