//! The message from the forward loop to postprocessing: one batch's
//! captured layers on the device, with what must live as long as they do.
//! It lives apart from both stages, so postprocessing need not import the
//! forward loop to learn what it receives.

use dflash_models::TopK;
use tch::Tensor;

use crate::upload::UploadedIds;
use crate::work::WorkItem;

/// A batch whose features exist (or are being computed) on the device: the
/// forward loop hands it to postprocessing by value, so nothing else can
/// touch its tensors, and they are freed only after they have been copied.
pub struct CapturedBatch {
    pub work: WorkItem,
    /// Residual stream after each captured layer, `[T, H]` each, in
    /// `target_layer_ids` order.
    pub layers: Vec<Tensor>,
    /// Distillation: the target's top-k next tokens at every position.
    pub top_k: Option<TopK>,
    /// On CUDA: one event per device of the instance (the home device first,
    /// [`crate::forward::CudaFeed::devices`]' order), each completing when
    /// that device's share of the forward is done. Layers stay on the device
    /// that computed them; the forward loop waits for none of these.
    pub ready: Vec<cudarc::driver::CudaEvent>,
    /// On CUDA: the ids the forward reads, held until the batch is dropped
    /// (after postprocessing has waited for the forward).
    #[allow(dead_code, reason = "held for ownership, never read")]
    pub ids: Option<UploadedIds>,
    /// On CUDA: the batch's `forward` span, open until the batch is dropped
    /// after postprocessing has waited for the GPU, so the span covers the
    /// forward's GPU time and not only its launch.
    #[allow(dead_code, reason = "held open, never read")]
    pub forward_span: Option<tracing::Span>,
}
