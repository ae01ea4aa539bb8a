//! One DFlash training step over a batch of target features: anchors,
//! micro-batches capped by sequences x anchors, memory-bounded chunked
//! cross-entropy, clipping, AdamW, and the step's metrics (loss, accuracy,
//! simulated acceptance length).

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use tch::{Kind, Tensor};

use crate::blocks::{BlockLayout, BlockSequence, BlockSettings, sample_anchors};
use crate::cuda::upload;
use crate::drafter::Drafter;
use crate::objective::{ChunkObjective, ChunkRows, SelectorPick, probability_kind};
pub use crate::objective::{Objective, dpace_weights};
use crate::optim::{AdamW, AdamWSettings, LrSchedule};

/// Settings of the training step.
#[derive(Clone, Debug)]
pub struct TrainSettings {
    pub blocks: BlockSettings,
    pub schedule: LrSchedule,
    pub adamw: AdamWSettings,
    /// Global gradient-norm clip (0: off).
    pub grad_clip: f64,
    /// Cap on sequences x anchors in one forward.
    pub max_blocks_per_micro_batch: usize,
    /// Blocks per chunk of the logits computation.
    pub loss_chunk_blocks: usize,
    /// Blocks per attention call (their keys: the context and their own
    /// slots); a large value attends over all blocks at once (dense mask).
    pub attention_chunk_blocks: usize,
    /// Micro-batch context lengths are rounded up to a multiple of this
    /// (masked padding), so attention sees few distinct shapes.
    pub context_pad_multiple: usize,
    /// Seed of anchor sampling (combined with the batch id).
    pub seed: u64,
    pub objective: Objective,
    /// DFlash2: weight of the selector's cross-entropy (ignored by a
    /// drafter without a selector).
    pub selector_loss_weight: f64,
}

/// A batch on the drafter's device, ready to train on.
pub struct DeviceBatch {
    pub batch_id: u64,
    /// Concatenated target features `[T, k*H]` in the drafter's kind.
    pub features: Tensor,
    pub input_ids: Vec<u32>,
    pub loss_mask: Vec<u8>,
    pub seq_lengths: Vec<u32>,
    /// Distillation: the target's top-k next tokens at every position
    /// (`[T, k]`, ids as Int64), on the drafter's device.
    pub target_top_k: Option<crate::TopK>,
    /// Memory `features` may view (a pooled device buffer); kept alive until
    /// the batch, and so its last use by a train step, is gone.
    pub landing: Option<Box<dyn std::any::Any + Send>>,
    /// W3C trace context of the stage that produced the batch, so the
    /// train step's span continues the batch's trace.
    pub trace_context: std::collections::HashMap<String, String>,
}

/// What one step measured.
#[derive(Clone, Debug, Default)]
pub struct StepMetrics {
    pub step: u64,
    pub loss: f64,
    /// Token accuracy over all supervised slots.
    pub accuracy: f64,
    /// Accuracy of each block slot 1..B-1.
    pub slot_accuracy: Vec<f64>,
    /// Simulated acceptance length: 1 + leading correct slots, per block.
    /// Correct means the slot's proposal (the top logit, or DFlash2's
    /// selector walk: given correct predecessors, the walk's pick) is the
    /// label.
    pub acceptance_length: f64,
    /// DFlash2: the fraction of supervised slots whose label is among the
    /// selector's candidates (the selector can pick it at all).
    pub candidate_recall: Option<f64>,
    pub tokens: u64,
    pub blocks: u64,
    pub grad_norm: f64,
    pub lr: f64,
}

/// The outcome of training on one batch.
#[derive(Debug)]
pub enum StepOutcome {
    Trained(StepMetrics),
    /// Nothing was applied to the weights; the reason says why.
    Skipped(String),
}

/// The drafter with its frozen target pieces and its optimizer.
pub struct Trainer {
    pub(crate) drafter: Drafter,
    /// The target's embedding and LM head, on the drafter's device.
    embed: Tensor,
    lm_head: Tensor,
    pub(crate) opt: AdamW,
    pub settings: TrainSettings,
}

#[derive(Default)]
struct Tally {
    loss_sum: f64,
    correct: Vec<f64>,
    counted: Vec<f64>,
    accept_sum: f64,
    blocks: f64,
    /// Supervised slots whose label is among the selector's candidates.
    recalled: f64,
}

/// A micro-batch's metrics over its supervised slots (weight > 0), per
/// block of `bm1` rows, left on the device: see [`PendingMetrics`].
/// `sums` are the loss sum and the selector's recalled slots.
fn pending_metrics(
    weights: &Tensor,
    correct_parts: &[Tensor],
    bm1: i64,
    sums: [Tensor; 2],
    layout: &BlockLayout,
) -> PendingMetrics {
    let valid = weights.gt(0.0).view([-1, bm1]);
    let correct = Tensor::cat(correct_parts, 0).view([-1, bm1]).logical_and(&valid);
    let per_slot_correct = correct.to_kind(Kind::Double).sum_dim_intlist(0, false, Kind::Double);
    let per_slot_counted = valid.to_kind(Kind::Double).sum_dim_intlist(0, false, Kind::Double);
    let accepted = correct.to_kind(Kind::Int64).cumprod(1, Kind::Int64).sum(Kind::Double);
    let [loss_sum, recalled] = sums;
    let scalars = Tensor::stack(&[loss_sum, accepted, recalled], 0);
    PendingMetrics {
        values: Tensor::cat(&[scalars, per_slot_correct, per_slot_counted], 0),
        blocks: layout.real_blocks as f64,
    }
}

/// A batch's micro-batches: each one's sequences (offset and length in
/// the batch) and its block layout.
struct MicroBatchPlan {
    members: Vec<Vec<(usize, usize)>>,
    layouts: Vec<BlockLayout>,
}

/// One micro-batch's metrics as the device computes them: `[loss sum,
/// accepted, recalled, correct per slot.., counted per slot..]` in f64,
/// and its real blocks. They are read back once, after the step's last
/// backward is queued: a read per micro-batch would make the host wait for
/// that backward before launching the next micro-batch, idling the GPU.
struct PendingMetrics {
    values: Tensor,
    blocks: f64,
}

/// The batch's input checks as the device computes them: one f64 flag
/// each (1: passed), read with the step's metrics, and what a failure of
/// each means (the first failed one is reported).
struct InputChecks {
    flags: Vec<Tensor>,
    reasons: Vec<&'static str>,
}

impl InputChecks {
    /// The first failed check's reason, given the flags' values as read.
    fn failed(&self, values: &[f64]) -> Option<String> {
        self.reasons.iter().zip(values).find(|(_, v)| **v != 1.0).map(|(r, _)| (*r).to_string())
    }
}

impl Tally {
    /// Adds every micro-batch's metrics, in order (the sums the host made
    /// when it read each micro-batch's at once), in one read from the device
    /// that also brings back `extra` (one-element f64 tensors: the input
    /// checks, the gradient norm), whose values it returns.
    fn settle(&mut self, pending: &[PendingMetrics], extra: &[Tensor]) -> Vec<f64> {
        let mut parts: Vec<Tensor> = extra.iter().map(|t| t.view([1])).collect();
        parts.extend(pending.iter().map(|p| p.values.shallow_clone()));
        if parts.is_empty() {
            return Vec::new();
        }
        let values = Vec::<f64>::try_from(Tensor::cat(&parts, 0).to_device(tch::Device::Cpu)).expect("f64 metrics");
        let (head, rows) = values.split_at(extra.len());
        let per = pending.first().map_or(1, |p| p.values.size()[0] as usize);
        let slots = self.correct.len();
        for (row, p) in rows.chunks(per).zip(pending) {
            self.loss_sum += row[0];
            self.recalled += row[2];
            for k in 0..slots {
                self.correct[k] += row[3 + k];
                self.counted[k] += row[3 + slots + k];
            }
            self.accept_sum += row[1] + p.blocks;
            self.blocks += p.blocks;
        }
        head.to_vec()
    }
}

impl Trainer {
    /// `embed` and `lm_head` are the target's `[vocab, H]` tables.
    pub fn new(drafter: Drafter, embed: Tensor, lm_head: Tensor, settings: TrainSettings) -> Self {
        let (device, kind) = (drafter.device(), drafter.kind());
        let embed = embed.to_device(device).to_kind(kind).detach();
        let lm_head = lm_head.to_device(device).to_kind(kind).detach();
        // Every parameter gets a (zero) gradient now, so that gradient
        // exchange between replicas always has a buffer to read and write.
        let touch = drafter
            .named_parameters()
            .iter()
            .map(|(_, p)| p.sum(Kind::Float) * 0.0)
            .reduce(|a, b| a + b)
            .expect("the drafter has parameters");
        touch.backward();
        let opt = AdamW::new(drafter.named_parameters(), settings.adamw.clone());
        Self { drafter, embed, lm_head, opt, settings }
    }

    /// Optimizer steps taken so far.
    pub fn step(&self) -> u64 {
        self.opt.step
    }

    /// Sets the step count (a replica that received the leader's state).
    pub fn set_step(&mut self, step: u64) {
        self.opt.step = step;
    }

    pub fn drafter(&self) -> &Drafter {
        &self.drafter
    }

    /// Every tensor replicas must hold alike: the parameters, then the
    /// optimizer's state.
    pub fn state_tensors(&self) -> Vec<Tensor> {
        let mut t: Vec<Tensor> = self.drafter.named_parameters().into_iter().map(|(_, p)| p).collect();
        t.extend(self.opt.state_tensors().into_iter().map(|(_, s)| s));
        t
    }

    pub fn embed(&self) -> &Tensor {
        &self.embed
    }

    pub fn lm_head(&self) -> &Tensor {
        &self.lm_head
    }

    /// Trains on one batch: one optimizer step, or a skip when features,
    /// loss or gradients are not finite (the weights stay untouched). The
    /// gradient norm comes back with the step's metrics, in the one read
    /// from the device a step makes before its optimizer update.
    pub fn train_batch(&mut self, batch: &DeviceBatch) -> StepOutcome {
        match self.compute_gradients_with_norm(batch) {
            (StepOutcome::Trained(m), Some(norm)) => self.apply_gradients_with_norm(m, norm),
            (StepOutcome::Trained(m), None) => self.apply_gradients(m),
            (skipped, _) => skipped,
        }
    }

    /// Zeroes the gradients and accumulates this batch's into them, with
    /// the batch's metrics (their step, lr and grad norm are filled in by
    /// [`Trainer::apply_gradients`]). Non-finite features or loss: skipped,
    /// gradients left at zero.
    pub fn compute_gradients(&mut self, batch: &DeviceBatch) -> StepOutcome {
        self.gradients(batch, false).0
    }

    /// [`Trainer::compute_gradients`] and the gradients' global norm, read
    /// from the device with the metrics, for a trainer whose gradients no
    /// exchange will change (no replicas): give it to
    /// [`Trainer::apply_gradients_with_norm`]. `None` when skipped.
    pub fn compute_gradients_with_norm(&mut self, batch: &DeviceBatch) -> (StepOutcome, Option<f64>) {
        self.gradients(batch, true)
    }

    /// [`Trainer::compute_gradients`], and with `norm_now` the gradients'
    /// global norm, read with the metrics.
    ///
    /// The batch's inputs are checked on the device and the verdict read
    /// with the metrics too: a read before the forward would make the host
    /// wait for the previous step's optimizer and leave the GPU idle while
    /// it plans this batch. A batch that fails the checks is skipped after
    /// its forward and backward, which its non-finite values cannot harm:
    /// the gradients are zeroed, the weights untouched.
    fn gradients(&mut self, batch: &DeviceBatch, norm_now: bool) -> (StepOutcome, Option<f64>) {
        self.opt.zero_grad();
        let skipped = |why: String| (StepOutcome::Skipped(format!("batch {}: {why}", batch.batch_id)), None);
        let (teacher, checks) = match self.input_checks(batch) {
            Ok(t) => t,
            Err(why) => return skipped(why),
        };
        let plan = self.plan_micro_batches(batch);
        let total_weight: f64 = match self.settings.objective {
            Objective::CrossEntropy | Objective::Distill => plan.layouts.iter().map(BlockLayout::total_weight).sum(),
            Objective::Dpace { .. } => plan.layouts.iter().map(|l| l.supervised_slots() as f64).sum(),
        };
        let b = self.settings.blocks.block_size;
        let mut tally = Tally { correct: vec![0.0; b - 1], counted: vec![0.0; b - 1], ..Tally::default() };
        if total_weight <= 0.0 {
            // Nothing to train on; the checks still name bad inputs first.
            return match checks.failed(&tally.settle(&[], &checks.flags)) {
                Some(why) => skipped(why),
                None => skipped("no trainable block positions".into()),
            };
        }
        let pending: Vec<PendingMetrics> = plan
            .members
            .iter()
            .zip(&plan.layouts)
            .map(|(feats, layout)| self.micro_batch(&batch.features, teacher, feats, layout, total_weight))
            .collect();
        let mut extra = checks.flags.iter().map(Tensor::shallow_clone).collect::<Vec<_>>();
        extra.extend(norm_now.then(|| self.opt.grad_norm_tensor()).flatten());
        let head = tally.settle(&pending, &extra);
        if let Some(why) = checks.failed(&head) {
            self.opt.zero_grad();
            return skipped(why);
        }
        let loss = tally.loss_sum / total_weight;
        if !loss.is_finite() {
            self.opt.zero_grad();
            return skipped(format!("non-finite loss {loss}"));
        }
        let norm = norm_now.then(|| head.get(checks.flags.len()).copied().unwrap_or(0.0));
        let counted: f64 = tally.counted.iter().sum();
        let metrics = StepMetrics {
            step: self.opt.step,
            loss,
            accuracy: tally.correct.iter().sum::<f64>() / counted.max(1.0),
            slot_accuracy: tally.correct.iter().zip(&tally.counted).map(|(c, n)| c / n.max(1.0)).collect(),
            acceptance_length: tally.accept_sum / tally.blocks.max(1.0),
            tokens: batch.input_ids.len() as u64,
            blocks: tally.blocks as u64,
            candidate_recall: self.drafter.selector().map(|_| tally.recalled / counted.max(1.0)),
            grad_norm: 0.0,
            lr: 0.0,
        };
        (StepOutcome::Trained(metrics), norm)
    }

    /// The batch's inputs checked before any work: the teacher present for
    /// distillation (on the host), then on the device finite features and
    /// the teacher's log-probabilities without NaN or +inf (-inf is a
    /// probability that underflowed: weight 0). Returns the teacher and the
    /// device checks, or why the batch is skipped.
    fn input_checks<'b>(&self, batch: &'b DeviceBatch) -> Result<(Option<&'b crate::TopK>, InputChecks), String> {
        let finite = |ok: Tensor| ok.to_kind(Kind::Double);
        let mut checks = InputChecks {
            flags: vec![finite(batch.features.isfinite().all())],
            reasons: vec!["non-finite target features"],
        };
        let teacher = match (self.settings.objective, &batch.target_top_k) {
            (Objective::Distill, None) => {
                return Err("distillation needs the target's top-k next tokens; the batch has none".into());
            }
            (Objective::Distill, Some(t)) => {
                let lp = &t.log_probs;
                checks.flags.push(finite(lp.isnan().logical_or(&lp.isposinf()).any().logical_not()));
                checks.reasons.push("non-finite log-probabilities in the target's top-k");
                Some(t)
            }
            _ => None,
        };
        Ok((teacher, checks))
    }

    /// The batch's anchors (deterministic in (seed, batch id), so a redone
    /// batch after a restart trains on the same blocks) and its
    /// micro-batches: consecutive sequences while sequences x anchors fits.
    fn plan_micro_batches(&self, batch: &DeviceBatch) -> MicroBatchPlan {
        let s = &self.settings;
        let mut rng = ChaCha8Rng::seed_from_u64(s.seed ^ batch.batch_id.wrapping_mul(0x2545_F491_4F6C_DD1D));
        let mut seqs = Vec::with_capacity(batch.seq_lengths.len());
        let mut offsets = Vec::with_capacity(batch.seq_lengths.len());
        let mut start = 0usize;
        for &len in &batch.seq_lengths {
            let len = len as usize;
            let ids = &batch.input_ids[start..start + len];
            let mask = &batch.loss_mask[start..start + len];
            let anchors = sample_anchors(mask, s.blocks.anchors_per_sequence, &mut rng);
            offsets.push(start);
            seqs.push(BlockSequence { input_ids: ids, loss_mask: mask, anchors });
            start += len;
        }
        let mut groups: Vec<Vec<usize>> = Vec::new();
        let mut cur_blocks = 0usize;
        for (i, q) in seqs.iter().enumerate() {
            if q.anchors.is_empty() {
                continue;
            }
            let n = groups.last().map_or(0, Vec::len);
            let padded = (n + 1) * cur_blocks.max(q.anchors.len());
            if groups.is_empty() || padded > s.max_blocks_per_micro_batch {
                groups.push(Vec::new());
                cur_blocks = 0;
            }
            cur_blocks = cur_blocks.max(q.anchors.len());
            groups.last_mut().expect("pushed above").push(i);
        }
        let layouts = groups
            .iter()
            .map(|g| {
                let members: Vec<BlockSequence> = g
                    .iter()
                    .map(|&i| BlockSequence {
                        input_ids: seqs[i].input_ids,
                        loss_mask: seqs[i].loss_mask,
                        anchors: seqs[i].anchors.clone(),
                    })
                    .collect();
                BlockLayout::new(&members, &s.blocks, s.attention_chunk_blocks)
                    .with_context_multiple(s.context_pad_multiple)
            })
            .collect();
        let members =
            groups.iter().map(|g| g.iter().map(|&i| (offsets[i], seqs[i].input_ids.len())).collect()).collect();
        MicroBatchPlan { members, layouts }
    }

    /// Clips the accumulated gradients and takes the optimizer step;
    /// skipped (weights untouched) when the gradient norm is not finite.
    pub fn apply_gradients(&mut self, m: StepMetrics) -> StepOutcome {
        let norm = self.opt.grad_norm();
        self.apply_gradients_with_norm(m, norm)
    }

    /// [`Trainer::apply_gradients`] with the gradients' norm already read
    /// ([`Trainer::compute_gradients_with_norm`]).
    pub fn apply_gradients_with_norm(&mut self, mut m: StepMetrics, grad_norm: f64) -> StepOutcome {
        self.opt.clip_to(grad_norm, self.settings.grad_clip);
        if !grad_norm.is_finite() {
            self.opt.zero_grad();
            return StepOutcome::Skipped("non-finite gradient norm".into());
        }
        let lr = self.settings.schedule.lr(self.opt.step);
        self.opt.step(lr);
        m.step = self.opt.step;
        m.grad_norm = grad_norm;
        m.lr = lr;
        StepOutcome::Trained(m)
    }

    /// Forward and backward of one micro-batch; gradients accumulate. The
    /// loss is scaled by the whole batch's weight so that the accumulated
    /// gradient equals the full batch's.
    fn micro_batch(
        &self,
        features: &Tensor,
        teacher: Option<&crate::TopK>,
        members: &[(usize, usize)],
        layout: &BlockLayout,
        total_weight: f64,
    ) -> PendingMetrics {
        let device = self.drafter.device();
        let kind = self.drafter.kind();
        let padded = self.padded_features(features, members, layout);
        let hidden = self.drafter.forward_layout(&padded, &self.embed, layout);
        let h = hidden.size()[2];
        let rows_idx = upload(&Tensor::from_slice(&layout.rows), device);
        let rows = hidden.view([-1, h]).index_select(0, &rows_idx); // [M, H]
        let labels = upload(&Tensor::from_slice(&layout.labels), device);
        let weights = upload(&Tensor::from_slice(&layout.weights), device);
        let selector = self.drafter.selector();
        let predecessors = selector.map(|_| upload(&Tensor::from_slice(&layout.predecessors()), device));
        // Distillation: each row's target top-k, read where its label's
        // distribution is (the position before the label), renormalized.
        let teacher = teacher.map(|t| {
            let at: Vec<i64> =
                layout.sources.iter().map(|&(i, p)| (members[i as usize].0 + p as usize) as i64).collect();
            let r = t.rows(&upload(&Tensor::from_slice(&at), device));
            (r.ids, r.log_probs.softmax(-1, if kind == Kind::Double { Kind::Double } else { Kind::Float }))
        });
        let mut picks = Vec::new(); // DFlash2: each chunk's candidates, for the selector's backward

        // The logits a chunk at a time (only one chunk of rows x vocab lives
        // at a time), their gradient from the objective (crate::objective),
        // back through the LM head into `grad`.
        let m = layout.rows.len() as i64;
        let chunk = (self.settings.loss_chunk_blocks * (layout.block_size - 1)) as i64;
        let bm1 = (layout.block_size - 1) as i64;
        let objective = ChunkObjective {
            objective: self.settings.objective,
            selector_weight: self.settings.selector_loss_weight,
            block_slots: bm1,
            acc: if kind == Kind::Double { Kind::Double } else { Kind::Float },
            probs_kind: probability_kind(kind),
        };
        let mut row_weights = Vec::new(); // each chunk's rows' weights, in `acc`
        let mut grad = Tensor::empty([m, h], (kind, device));
        let mut correct_parts = Vec::new();
        let mut loss_parts = Vec::new();
        let no_grad = tch::no_grad_guard();
        let mut start = 0;
        while start < m {
            let len = chunk.min(m - start);
            let x = rows.narrow(0, start, len);
            let logits = x.linear(&self.lm_head, None::<Tensor>);
            let lab = labels.narrow(0, start, len).unsqueeze(1);
            let w = weights.narrow(0, start, len);
            let pick = selector.zip(predecessors.as_ref()).map(|(sel, pred)| {
                SelectorPick::new(sel, &x, sel.candidates(&logits), &pred.narrow(0, start, len), &lab, w.gt(0.0))
            });
            let taught = teacher.as_ref().map(|(ids, p)| (ids.narrow(0, start, len), p.narrow(0, start, len)));
            let terms =
                objective.terms(logits, ChunkRows { labels: &lab, teacher: taught, weights: &w, pick: pick.as_ref() });
            correct_parts.push(terms.correct);
            loss_parts.extend(terms.losses);
            row_weights.push(terms.weights);
            picks.extend(pick);
            let _ = terms.dlogits.to_kind(kind).matmul_out(&grad.narrow(0, start, len), &self.lm_head);
            start += len;
        }
        let scale = Tensor::cat(&row_weights, 0) / total_weight; // [M]: each row's share of the loss
        let _ = grad.g_mul_(&scale.unsqueeze(1).to_kind(kind));
        drop(no_grad);
        let mut loss = (&rows * &grad).sum(Kind::Float);
        let mut recalled = Tensor::zeros([], (Kind::Double, device));
        if let (Some(sel), Some(pred)) = (selector, &predecessors) {
            let (term, hits) = objective.selector_term(sel, &rows, &picks, pred, &scale);
            loss = loss.to_kind(objective.acc) + term;
            recalled = hits.to_kind(Kind::Double).sum(Kind::Double);
        }
        loss.backward();
        let loss_sum = Tensor::stack(&loss_parts, 0).sum(Kind::Double);

        pending_metrics(&weights, &correct_parts, bm1, [loss_sum, recalled], layout)
    }

    /// The micro-batch's sequences' features, each padded to the layout's
    /// context length: `[n, S, k*H]`.
    fn padded_features(&self, features: &Tensor, members: &[(usize, usize)], layout: &BlockLayout) -> Tensor {
        let (n, s) = (layout.n as i64, layout.context_len as i64);
        let padded = Tensor::zeros([n, s, features.size()[1]], (self.drafter.kind(), self.drafter.device()));
        for (i, &(off, len)) in members.iter().enumerate() {
            padded.get(i as i64).narrow(0, 0, len as i64).copy_(&features.narrow(0, off as i64, len as i64));
        }
        padded
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DrafterConfig;
    use crate::optim::{AdamWSettings, LrSchedule};
    use crate::synthetic::synthetic_target_config;
    use tch::Device;

    /// The hand-written cross-entropy gradient against libtorch's autograd
    /// through `cross_entropy_loss`, in f64: loss and every parameter's
    /// gradient of one micro-batch.
    #[test]
    fn hand_written_cross_entropy_matches_autograd() {
        cross_entropy_against_autograd(Device::Cpu, Kind::Double, 1e-12, 1e-10);
    }

    /// In bf16 the probabilities are written in bf16 (no fp32 rows x vocab
    /// tensor): loss and gradients agree with autograd through an fp32
    /// cross-entropy of the same bf16 logits to bf16 precision.
    #[test]
    fn bf16_cross_entropy_matches_an_fp32_cross_entropy() {
        cross_entropy_against_autograd(Device::Cpu, Kind::BFloat16, 1e-3, 3e-2);
    }

    /// The same on CUDA, where the drafter's attention is the split one.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn bf16_cross_entropy_on_cuda_matches_an_fp32_cross_entropy() {
        let gpu = crate::cuda::tch_device(Some(0)).expect("a CUDA device");
        cross_entropy_against_autograd(gpu, Kind::BFloat16, 1e-3, 3e-2);
    }

    /// One micro-batch through `Trainer::micro_batch` and through autograd
    /// (cross-entropy of the logits in fp32, or f64 for an f64 drafter):
    /// the loss within `loss_tol` (relative), every gradient within
    /// `grad_tol` of its largest entry.
    fn cross_entropy_against_autograd(device: Device, kind: Kind, loss_tol: f64, grad_tol: f64) {
        objective_against_autograd(device, kind, Objective::CrossEntropy, None, loss_tol, grad_tol, false);
    }

    /// bf16 on slots a trained drafter is sure of (p of the label near 1):
    /// the hand-written gradient keeps p - 1 to half precision's relative
    /// accuracy, as autograd through an fp32 cross-entropy does.
    #[test]
    fn bf16_gradient_of_confident_slots_matches_fp32() {
        objective_against_autograd(Device::Cpu, Kind::BFloat16, Objective::CrossEntropy, None, 1e-3, 3e-2, true);
        objective_against_autograd(Device::Cpu, Kind::BFloat16, Objective::Distill, None, 1e-3, 3e-2, true);
    }

    /// D-PACE's weights on a small case worked by hand: an unsupervised
    /// slot is a no-op in the products and adds nothing to the sums.
    #[test]
    fn dpace_weights_match_the_definition() {
        let p = Tensor::from_slice(&[0.5f64, 0.2, 0.9, 0.5, 0.2, 0.9]).view([2, 3]);
        let valid = Tensor::from_slice(&[true, true, true, true, false, true]).view([2, 3]);
        let w = Vec::<f64>::try_from(dpace_weights(&p, &valid, 0.5).view([-1])).unwrap();
        // q = 0.5 p + 0.5; w_j = sum_{m>=j} prod_{i<=m} q_i over supervised slots.
        let want = [0.75 + 0.45 + 0.4275, 0.45 + 0.4275, 0.4275, 0.75 + 0.7125, 0.0, 0.7125];
        for (g, w) in w.iter().zip(want) {
            assert!((g - w).abs() < 1e-12, "{g} vs {w}");
        }
    }

    /// D-PACE through `Trainer::micro_batch` against autograd of the
    /// weighted cross-entropy, the weights computed slot by slot from the
    /// reference's own label probabilities.
    #[test]
    fn dpace_matches_autograd_in_f64() {
        objective_against_autograd(Device::Cpu, Kind::Double, Objective::Dpace { alpha: 0.5 }, None, 1e-9, 1e-9, false);
    }

    /// DFlash2: the block objective plus the selector's cross-entropy over
    /// each slot's top-k candidates given the true predecessor (through
    /// the unary logits too: topk's own backward in the reference), against
    /// autograd, with every convolution and selector weight random so each
    /// path carries gradient.
    #[test]
    fn dflash2_matches_autograd_in_f64() {
        objective_against_autograd(Device::Cpu, Kind::Double, Objective::CrossEntropy, Some(0.7), 1e-9, 1e-9, false);
        objective_against_autograd(
            Device::Cpu,
            Kind::Double,
            Objective::Dpace { alpha: 0.5 },
            Some(1.0),
            1e-9,
            1e-9,
            false,
        );
    }

    /// Distillation through `Trainer::micro_batch` against autograd of the
    /// soft cross-entropy to a random target's renormalized top-k, read at
    /// each label's previous position.
    #[test]
    fn distillation_matches_autograd_in_f64() {
        objective_against_autograd(Device::Cpu, Kind::Double, Objective::Distill, None, 1e-9, 1e-9, false);
    }

    /// One micro-batch through `Trainer::micro_batch` and through autograd
    /// (see [`cross_entropy_against_autograd`]). `confident`: every label is
    /// the drafter's own top token and the LM head is scaled up, so every
    /// slot puts about 0.996-0.998 on its label (a trained drafter's regime,
    /// where p - 1 is small and a half-precision p near 1 would round it away).
    fn objective_against_autograd(
        device: Device,
        kind: Kind,
        objective: Objective,
        selector_weight: Option<f64>,
        loss_tol: f64,
        grad_tol: f64,
        confident: bool,
    ) {
        let tc = synthetic_target_config(2);
        tch::manual_seed(7);
        let mut dc = DrafterConfig::for_target(&tc, 1, 4, 3, vec![0, 1]);
        dc.dflash2 = selector_weight.map(|_| crate::dflash2::Dflash2Config {
            conv_kernel_size: 2,
            conv_group_size: 4,
            selector_rank: 8,
            // Half the vocabulary: some labels among the candidates, some not.
            selector_top_k: 130,
        });
        let drafter = Drafter::new(dc, device, kind);
        if selector_weight.is_some() {
            let _guard = tch::no_grad_guard();
            for (name, mut p) in drafter.named_parameters() {
                if name.contains("_conv.") || name.contains("candidate_selector.") {
                    let _ = p.g_add_(&(p.randn_like() * 0.3));
                }
            }
        }
        let opts = (kind, device);
        let embed = Tensor::randn([tc.vocab_size, tc.hidden_size], opts);
        let head = Tensor::randn([tc.vocab_size, tc.hidden_size], opts) * if confident { 2.6 } else { 0.3 };
        let settings = TrainSettings {
            blocks: BlockSettings { block_size: 4, mask_token_id: 3, gamma: 4.0, anchors_per_sequence: 5 },
            schedule: LrSchedule::new(1e-3, 10, 0.0, 0.0),
            adamw: AdamWSettings { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 },
            grad_clip: 0.0,
            max_blocks_per_micro_batch: 100,
            loss_chunk_blocks: 2, // several loss chunks, the last one partial
            attention_chunk_blocks: 100,
            context_pad_multiple: 1,
            seed: 1,
            objective,
            selector_loss_weight: selector_weight.unwrap_or(0.0),
        };
        let trainer = Trainer::new(drafter, embed, head, settings);
        let mut ids: Vec<u32> = (0..19).map(|i| 10 + (i * 13) % 150).collect();
        let mut mask = vec![1u8; 19];
        mask[..3].fill(0);
        mask[11] = 0;
        // Confident: blocks that do not overlap, so no label is another block's input.
        let anchors = if confident { vec![3, 7, 11, 15] } else { vec![3, 5, 8, 12, 16] };
        let features = Tensor::randn([19, 2 * tc.hidden_size], opts);
        let seqs = [BlockSequence { input_ids: &ids, loss_mask: &mask, anchors: anchors.clone() }];
        let mut layout = BlockLayout::new(&seqs, &trainer.settings.blocks, 100);
        if confident {
            let _guard = tch::no_grad_guard();
            let hidden = trainer.drafter.forward_layout(&features.unsqueeze(0), trainer.embed(), &layout);
            let rows = hidden.view([-1, tc.hidden_size]).index_select(0, &Tensor::from_slice(&layout.rows));
            let top = Vec::<i64>::try_from(rows.linear(trainer.lm_head(), None::<Tensor>).argmax(-1, false)).unwrap();
            for (&(_, p), &t) in layout.sources.iter().zip(&top) {
                ids[p as usize + 1] = t as u32;
            }
            let seqs = [BlockSequence { input_ids: &ids, loss_mask: &mask, anchors }];
            layout = BlockLayout::new(&seqs, &trainer.settings.blocks, 100);
        }
        // A target's top-6 at each of the 19 positions (distillation only):
        // random, or (confident) a sharper copy of the drafter's own logits
        // where the rows read it, so both put most of their mass on one token.
        let teacher = (objective == Objective::Distill).then(|| {
            let mut logits = Tensor::randn([19, tc.vocab_size], (Kind::Float, device)) * 2.0;
            if confident {
                let _guard = tch::no_grad_guard();
                let hidden = trainer.drafter.forward_layout(&features.unsqueeze(0), trainer.embed(), &layout);
                let rows = hidden.view([-1, tc.hidden_size]).index_select(0, &Tensor::from_slice(&layout.rows));
                let own = rows.linear(trainer.lm_head(), None::<Tensor>).to_kind(Kind::Float) * 1.3;
                let at: Vec<i64> = layout.sources.iter().map(|&(_, p)| p as i64).collect();
                logits = logits.index_copy(0, &Tensor::from_slice(&at), &own);
            }
            let (log_probs, ids) = logits.log_softmax(-1, Kind::Float).topk(6, -1, true, true);
            crate::TopK { ids, log_probs }
        });
        let total = match objective {
            Objective::CrossEntropy | Objective::Distill => layout.total_weight(),
            Objective::Dpace { .. } => layout.supervised_slots() as f64,
        } * 1.5; // as if other micro-batches shared the step
        let grads = |t: &Trainer| -> Vec<Tensor> {
            t.drafter.named_parameters().into_iter().map(|(_, p)| p.grad().to_kind(Kind::Double)).collect()
        };

        let mut tally = Tally { correct: vec![0.0; 3], counted: vec![0.0; 3], ..Tally::default() };
        for (_, p) in trainer.drafter.named_parameters() {
            let _ = p.grad().zero_();
        }
        let pending = trainer.micro_batch(&features, teacher.as_ref(), &[(0, 19)], &layout, total);
        tally.settle(&[pending], &[]);
        let (loss, got) = (tally.loss_sum / total, grads(&trainer));

        for (_, p) in trainer.drafter.named_parameters() {
            let _ = p.grad().zero_();
        }
        let hidden = trainer.drafter.forward_layout(&features.unsqueeze(0), trainer.embed(), &layout);
        let rows =
            hidden.view([-1, tc.hidden_size]).index_select(0, &Tensor::from_slice(&layout.rows).to_device(device));
        let logits = rows.linear(trainer.lm_head(), None::<Tensor>);
        let acc = if kind == Kind::Double { Kind::Double } else { Kind::Float };
        let ce = match &teacher {
            Some(t) => {
                // The label at position p is predicted by the target at p - 1.
                let at: Vec<i64> = layout.sources.iter().map(|&(_, p)| p as i64).collect();
                assert!(layout.labels.iter().zip(&at).all(|(&l, &p)| l == 0 || ids[p as usize + 1] as i64 == l));
                let r = t.rows(&Tensor::from_slice(&at).to_device(device));
                let p = r.log_probs.softmax(-1, Kind::Double);
                let log_q = logits.to_kind(acc).log_softmax(-1, acc).gather(1, &r.ids, false).to_kind(Kind::Double);
                (log_q * p).sum_dim_intlist(1, false, Kind::Double).neg()
            }
            None => logits.to_kind(acc).cross_entropy_loss::<Tensor>(
                &Tensor::from_slice(&layout.labels).to_device(device),
                None,
                tch::Reduction::None,
                -100,
                0.0,
            ),
        };
        let mut weights = Tensor::from_slice(&layout.weights).to_device(device).to_kind(Kind::Double);
        if let Objective::Dpace { alpha } = objective {
            let p = Vec::<f64>::try_from(ce.detach().to_kind(Kind::Double).neg().exp().to_device(Device::Cpu)).unwrap();
            let b = layout.block_size - 1;
            let mut w = vec![0.0; p.len()];
            for blk in 0..p.len() / b {
                let ok = |j: usize| layout.weights[blk * b + j] > 0.0;
                let q = |j: usize| if ok(j) { (1.0 - alpha) * p[blk * b + j] + alpha } else { 1.0 };
                for j in (0..b).filter(|&j| ok(j)) {
                    w[blk * b + j] = (j..b).filter(|&m| ok(m)).map(|m| (0..=m).map(q).product::<f64>()).sum::<f64>();
                }
            }
            weights = Tensor::from_slice(&w).to_device(device);
        }
        let mut want_loss = (ce.to_kind(Kind::Double) * &weights).sum(Kind::Double) / total;
        if let (Some(lambda), Some(sel)) = (selector_weight, trainer.drafter.selector()) {
            let (unary, candidates) = logits.topk(sel.top_k, -1, true, true);
            let pred = Tensor::from_slice(&layout.predecessors()).to_device(device);
            let labels = Tensor::from_slice(&layout.labels).to_device(device).unsqueeze(1);
            let matches = candidates.eq_tensor(&labels);
            let hit = matches.any_dim(1, false).to_kind(Kind::Double);
            let target = matches.to_kind(Kind::Int64).argmax(1, false).unsqueeze(1);
            let scores = sel.scores(&rows, &unary, &candidates, &pred);
            let sel_ce = -scores.log_softmax(-1, Kind::Double).gather(1, &target, false).squeeze_dim(1) * &hit;
            let hits = hit.sum(Kind::Double).double_value(&[]);
            assert!(
                hits >= 3.0 && hits < hit.size()[0] as f64,
                "{hits} labels among the candidates: compare both cases"
            );
            want_loss += (sel_ce * weights.detach()).sum(Kind::Double) * lambda / total;
        }
        want_loss.backward();
        let want = want_loss.double_value(&[]);
        assert!((loss - want).abs() < loss_tol * want.abs().max(1.0), "loss {loss} vs {want}");
        for ((name, _), (g, w)) in trainer.drafter.named_parameters().iter().zip(got.iter().zip(grads(&trainer))) {
            let err = (g - &w).abs().max().double_value(&[]);
            let size = w.abs().max().double_value(&[]);
            assert!(size > 0.0, "{name}: no gradient");
            // f64: absolute below size 1; bf16: relative to the gradient's size.
            let scale = if kind == Kind::Double { size.max(1.0) } else { size };
            assert!(err < grad_tol * scale, "{name}: gradient differs by {err} (size {size})");
        }
    }
}
