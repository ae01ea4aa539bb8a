//! What the drafted rows are trained against, one chunk of rows at a time:
//! the truth of a row (the next token, or the target's distribution there),
//! how the rows are weighted (by the layout, or by D-PACE), DFlash2's
//! selector term, and the gradient of all of it on the chunk's logits,
//! written by hand. The trainer's chunk loop ([`crate::trainer`]) runs the
//! LM head, calls [`ChunkObjective::terms`] and multiplies the gradient back
//! through the head.
//!
//! Why by hand: d(sum w CE)/d(logits) = w (softmax - target). The softmax
//! reads the logits, accumulates in fp32 and writes the probabilities in the
//! kind the LM head's backward matmul reads: the model's own kind when it is
//! a half type (one rounding per entry, as rounding fp32 probabilities would
//! give), so no fp32 rows x vocab tensor is written and read back. Autograd
//! through an fp32 cross-entropy would add an fp32 copy of the logits, a
//! dense one-hot gradient and conversions (each a full pass over rows x
//! vocab). The label's entry, p - 1, is not the rounded p minus 1 (near
//! p = 1 that loses all of it) but minus the sum of the other rounded
//! probabilities, each held to half precision's relative accuracy. On a GPU
//! the argmax, the softmax and that sum are one kernel over the logits
//! ([`crate::softmax_cuda`]); elsewhere three ops, the sum one extra read of
//! the chunk's probabilities.

use tch::{Kind, Tensor};

/// The loss over the drafted slots of a batch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Objective {
    /// Cross-entropy, slot k weighted by the layout (`exp(-(k-1)/gamma)`),
    /// normalized by the batch's total weight.
    CrossEntropy,
    /// D-PACE: the cross-entropy of slot j weighted by `w_j = sum_{m>=j}
    /// prod_{i<=m} q_i`, `q_i = (1 - alpha) p_i + alpha` with `p_i` the
    /// drafter's probability of the label (detached: weights, not a path
    /// for gradients); a slot without a label is a no-op in the products
    /// and adds nothing to the sums. Normalized by the batch's supervised
    /// slots, so the loss reads as weighted cross-entropy per slot.
    Dpace { alpha: f64 },
    /// Distillation: the cross-entropy of slot k against the target's
    /// next-token distribution at the same position (its top-k, shipped in
    /// [`crate::DeviceBatch::target_top_k`], renormalized), weighted like
    /// [`Objective::CrossEntropy`]. A slot is correct when its proposal is
    /// the target's most likely token: what greedy verification accepts.
    Distill,
}

/// D-PACE's weights `[blocks, B-1]` from the label probabilities `p` and
/// the supervised slots `valid` (both `[blocks, B-1]`), in `p`'s kind.
pub fn dpace_weights(p: &Tensor, valid: &Tensor, alpha: f64) -> Tensor {
    let q = (p * (1.0 - alpha) + alpha).where_self(valid, &p.ones_like());
    let prefix = q.cumprod(1, p.kind());
    let counted = prefix * valid.to_kind(p.kind());
    let suffix = counted.flip([1]).cumsum(1, p.kind()).flip([1]);
    suffix * valid.to_kind(p.kind())
}

/// The objective as the chunk loop applies it: the settings and the kinds
/// of one micro-batch.
pub(crate) struct ChunkObjective {
    pub objective: Objective,
    /// DFlash2: weight of the selector's cross-entropy.
    pub selector_weight: f64,
    /// Slots per block (B-1): chunks hold whole blocks, so D-PACE's
    /// per-block products see every slot of a block.
    pub block_slots: i64,
    /// The kind sums are taken in: f64 for an f64 drafter (tests), else fp32.
    pub acc: Kind,
    /// The kind the probabilities (and the gradient on the logits) are written in.
    pub probs_kind: Kind,
}

/// One chunk's rows: their truth and the layout's weights.
pub(crate) struct ChunkRows<'a> {
    /// `[len, 1]` the next tokens.
    pub labels: &'a Tensor,
    /// Distillation: the target's top-k ids `[len, k]` and renormalized
    /// probabilities `[len, k]`.
    pub teacher: Option<(Tensor, Tensor)>,
    /// `[len]` the layout's weights (0: not supervised).
    pub weights: &'a Tensor,
    /// DFlash2: the selector on these rows.
    pub pick: Option<&'a SelectorPick>,
}

/// One chunk's terms.
pub(crate) struct ChunkTerms {
    /// Its weighted losses (f64 scalars, not yet normalized).
    pub losses: Vec<Tensor>,
    /// `[len]` whether each row's proposal is right.
    pub correct: Tensor,
    /// `[len]` each row's weight in the loss (in `acc`).
    pub weights: Tensor,
    /// `[len, vocab]` the gradient on the logits before the row weights
    /// (in `probs_kind`).
    pub dlogits: Tensor,
}

impl ChunkObjective {
    /// The terms of one chunk, given its logits (consumed: only the
    /// probabilities live on).
    pub fn terms(&self, logits: Tensor, rows: ChunkRows) -> ChunkTerms {
        let ChunkRows { labels: lab, teacher: taught, weights: w, pick } = rows;
        let acc = self.acc;
        // On a GPU one kernel writes the probabilities over the logits and
        // gives each row's argmax and the sum of its probabilities as written
        // (crate::softmax_cuda); elsewhere the ops below do the same.
        // Greedy verification accepts the target's most likely token.
        let proposal_right = |argmax: Tensor| match &taught {
            Some((ids, _)) => argmax.eq_tensor(&ids.select(1, 0)),
            None => argmax.eq_tensor(&lab.squeeze_dim(1)),
        };
        let fused =
            if logits.kind() == self.probs_kind { crate::softmax_cuda::softmax_in_place(logits) } else { Err(logits) };
        let (mut probs, correct, sums) = match fused {
            Ok(f) => (f.probs, pick.map_or_else(|| proposal_right(f.argmax), |p| p.correct()), Some(f.sums)),
            Err(logits) => {
                let correct = pick.map_or_else(|| proposal_right(logits.argmax(-1, false)), |p| p.correct());
                (logits.softmax(-1, self.probs_kind), correct, None)
            }
        };
        // CE = -log p[label]; p is clamped at the smallest normal float,
        // so a confidently wrong slot reports a loss of at most ~87 where
        // a log-sum-exp would report more (its gradient is exact either way).
        let p_label = probs.gather(1, lab, false).squeeze_dim(1);
        // 1 - p of the label as the sum of the other probabilities, taken
        // before anything is added to `probs`: each of them is small and
        // held to half precision's relative accuracy, where p itself, near
        // 1, rounds by up to 2^-9 absolute -- as much as a confident slot's
        // whole 1 - p, whose gradient `p - 1` would round away with it.
        // Distillation: the same for the target's top token, where the
        // drafter's p may be near 1 too.
        let first = match &taught {
            Some((ids, _)) => probs.gather(1, &ids.narrow(1, 0, 1), false).squeeze_dim(1),
            None => p_label.shallow_clone(),
        };
        let sums = sums.map_or_else(|| probs.sum_dim_intlist(-1, false, acc), |s| s.to_kind(acc));
        let rest = sums - first.to_kind(acc);
        let log_p = |p: Tensor| p.to_kind(Kind::Double).clamp_min(f64::from(f32::MIN_POSITIVE)).log();
        let ce = match &taught {
            // -sum_j p_target(j) log p(j) over the target's top-k.
            Some((ids, p)) => (log_p(probs.gather(1, ids, false)) * p.to_kind(Kind::Double))
                .sum_dim_intlist(1, false, Kind::Double)
                .neg(),
            None => log_p(p_label.shallow_clone()).neg(),
        };
        let w = match self.objective {
            Objective::CrossEntropy | Objective::Distill => w.to_kind(acc),
            Objective::Dpace { alpha } => {
                let valid = w.gt(0.0).view([-1, self.block_slots]);
                dpace_weights(&p_label.to_kind(acc).view([-1, self.block_slots]), &valid, alpha).view([-1])
            }
        };
        let mut losses = vec![(&ce * w.to_kind(Kind::Double)).sum(Kind::Double)];
        // DFlash2: the selector's gradient at each row's label (0 where
        // the candidates miss it), re-added when the label's entry is set.
        let mut selector_at_label = None;
        if let Some(pick) = pick {
            // The selector's cross-entropy, weighted like the block's, and
            // its gradient on the candidates' logits (the unary scores):
            // lambda * (softmax - onehot) over the k candidates.
            let lambda = self.selector_weight;
            losses.push((pick.cross_entropy() * w.to_kind(Kind::Double)).sum(Kind::Double) * lambda);
            let g = pick.score_gradient(acc) * lambda;
            selector_at_label = Some(g.gather(1, &pick.target.unsqueeze(1), false).squeeze_dim(1));
            let _ = probs.scatter_add_(1, &pick.candidates, &g.to_kind(self.probs_kind));
        }
        // d/d(logits) = softmax - target: the one-hot label, or the
        // target's renormalized top-k.
        let _ = match &taught {
            // The top token's entry q - p_target = (1 - p_target) - (1 - q).
            Some((ids, p)) => {
                let _ = probs.scatter_add_(1, ids, &p.neg().to_kind(self.probs_kind));
                let at_first = p.narrow(1, 1, p.size()[1] - 1).sum_dim_intlist(1, false, acc) - &rest;
                probs.scatter_(1, &ids.narrow(1, 0, 1), &at_first.unsqueeze(1).to_kind(self.probs_kind))
            }
            // The label's entry is p - 1 = -(1 - p), plus the selector's
            // gradient there when DFlash2's candidates hold the label.
            None => {
                let at_label = selector_at_label.map_or_else(|| rest.neg(), |s| s - &rest);
                probs.scatter_(1, lab, &at_label.unsqueeze(1).to_kind(self.probs_kind))
            }
        };
        ChunkTerms { losses, correct, weights: w, dlogits: probs }
    }

    /// DFlash2: the selector's own term of the objective over a micro-batch's
    /// chunks, for autograd (its parameters, and the hidden `rows` through
    /// its projection; the unary scores are constants here, their gradient
    /// went into each chunk's `dlogits`), and how many supervised rows had
    /// their label among the candidates. `scale` `[M]`: each row's share of
    /// the loss.
    pub fn selector_term(
        &self,
        sel: &crate::dflash2::CandidateSelector,
        rows: &Tensor,
        picks: &[SelectorPick],
        predecessors: &Tensor,
        scale: &Tensor,
    ) -> (Tensor, Tensor) {
        let acc = self.acc;
        let all = |field: fn(&SelectorPick) -> &Tensor| Tensor::cat(&picks.iter().map(field).collect::<Vec<_>>(), 0);
        let (target, hit) = (all(|p| &p.target), all(|p| &p.hit));
        let scores = sel.scores(rows, &all(|p| &p.unary), &all(|p| &p.candidates), predecessors);
        let log_p = scores.log_softmax(-1, acc).gather(1, &target.unsqueeze(1), false).squeeze_dim(1);
        let share = scale.to_kind(acc) * hit.to_kind(acc) * self.selector_weight;
        let recalled = hit.logical_and(&all(|p| &p.supervised));
        (-(log_p * share).sum(acc), recalled)
    }
}

/// DFlash2's selector on one chunk of rows: each row's candidates, their
/// scores given the true predecessor, and where the label sits among them.
pub(crate) struct SelectorPick {
    /// `[len, k]` logits of the candidates (the unary scores).
    unary: Tensor,
    /// `[len, k]` token ids.
    candidates: Tensor,
    /// `[len, k]` selector scores (no gradient).
    scores: Tensor,
    /// `[len]` the label's index among the candidates (0 when absent).
    target: Tensor,
    /// `[len]` whether the label is among the candidates: a row without it
    /// has nothing to select, and trains the block objective only.
    hit: Tensor,
    /// `[len]` whether the row is supervised at all.
    supervised: Tensor,
}

impl SelectorPick {
    pub fn new(
        sel: &crate::dflash2::CandidateSelector,
        rows: &Tensor,
        (unary, candidates): (Tensor, Tensor),
        predecessors: &Tensor,
        labels: &Tensor,
        supervised: Tensor,
    ) -> Self {
        let scores = sel.scores(rows, &unary, &candidates, predecessors);
        let matches = candidates.eq_tensor(labels); // labels [len, 1]
        let hit = matches.any_dim(1, false);
        let target = matches.to_kind(Kind::Int64).argmax(1, false);
        Self { unary, candidates, scores, target, hit, supervised }
    }

    /// Whether the selector's pick (argmax score given the true
    /// predecessor) is the label.
    fn correct(&self) -> Tensor {
        self.scores.argmax(-1, false).eq_tensor(&self.target).logical_and(&self.hit)
    }

    /// `[len]` cross-entropy of the label's candidate (0 where absent).
    fn cross_entropy(&self) -> Tensor {
        let log_p =
            self.scores.log_softmax(-1, Kind::Double).gather(1, &self.target.unsqueeze(1), false).squeeze_dim(1);
        -log_p * self.hit.to_kind(Kind::Double)
    }

    /// `[len, k]` d(cross-entropy)/d(scores) in `acc`: softmax - onehot,
    /// 0 where absent.
    fn score_gradient(&self, acc: Kind) -> Tensor {
        let p = self.scores.softmax(-1, acc);
        let onehot = p.zeros_like().scatter_value(1, &self.target.unsqueeze(1), 1.0);
        (p - onehot) * self.hit.to_kind(acc).unsqueeze(1)
    }
}

/// The kind the loss writes its rows x vocab probabilities in: a half
/// model kind itself (what the LM head's backward matmul reads), f32 and f64
/// as they are.
pub(crate) fn probability_kind(model: Kind) -> Kind {
    match model {
        Kind::BFloat16 | Kind::Half | Kind::Double => model,
        _ => Kind::Float,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Largest |a - b| / (|b| + floor) over the entries.
    fn worst(a: &Tensor, b: &Tensor, floor: f64) -> f64 {
        let (a, b) = (a.to_kind(Kind::Double), b.to_kind(Kind::Double));
        ((&a - &b).abs() / (b.abs() + floor)).max().double_value(&[])
    }

    /// On a GPU the terms of a chunk through the softmax kernel
    /// ([`crate::softmax_cuda`]) are the terms through the ops (the same
    /// logits as a view the kernel declines) to the precision of the
    /// probabilities' kind: the proposals' rightness exactly, the losses,
    /// the weights and the gradient on the logits; for cross-entropy, D-PACE
    /// and distillation, in bf16 and f32.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn the_softmax_kernel_gives_the_terms_of_the_ops() {
        let dev = crate::cuda::tch_device(Some(0)).expect("a CUDA device");
        tch::manual_seed(3);
        let (slots, v, k) = (15, 1024, 8);
        let len = 24 * slots;
        let labels = Tensor::randint(v, [len, 1], (Kind::Int64, dev));
        let weights = Tensor::rand([len], (Kind::Float, dev)).gt(0.2).to_kind(Kind::Float)
            * Tensor::rand([len], (Kind::Float, dev));
        let ids = Tensor::rand([len, v], (Kind::Float, dev)).argsort(-1, false).narrow(1, 0, k);
        let teacher_p = Tensor::rand([len, k], (Kind::Float, dev)).softmax(-1, Kind::Float);
        for kind in [Kind::BFloat16, Kind::Float] {
            let wide = (Tensor::randn([len, v + 8], (Kind::Float, dev)) * 3.0).to_kind(kind);
            let view = wide.narrow(1, 0, v); // not contiguous: the ops
            let (tol, floor) = if kind == Kind::Float { (1e-5, 1e-6) } else { (1.0 / 64.0, 1e-2) };
            for objective in [Objective::CrossEntropy, Objective::Dpace { alpha: 0.3 }, Objective::Distill] {
                let obj = ChunkObjective {
                    objective,
                    selector_weight: 0.0,
                    block_slots: slots,
                    acc: Kind::Float,
                    probs_kind: probability_kind(kind),
                };
                let rows = || ChunkRows {
                    labels: &labels,
                    teacher: (objective == Objective::Distill).then(|| (ids.copy(), teacher_p.copy())),
                    weights: &weights,
                    pick: None,
                };
                let before = crate::softmax_cuda::LAUNCHES.load(std::sync::atomic::Ordering::Relaxed);
                let fused = obj.terms(view.contiguous(), rows());
                assert!(crate::softmax_cuda::LAUNCHES.load(std::sync::atomic::Ordering::Relaxed) > before);
                let ops = obj.terms(view.shallow_clone(), rows());
                let at = format!("{kind:?} {objective:?}");
                assert!(fused.correct.equal(&ops.correct), "{at}: right proposals");
                for (f, o) in fused.losses.iter().zip(&ops.losses) {
                    let e = worst(f, o, 1e-6);
                    assert!(e <= tol, "{at}: loss off by {e}");
                }
                assert!(worst(&fused.weights, &ops.weights, 1e-6) <= tol, "{at}: weights");
                let e = worst(&fused.dlogits, &ops.dlogits, floor);
                assert!(e <= tol, "{at}: gradient on the logits off by {e}");
            }
        }
    }
}
