//! Data-parallel lockstep over any collective: NCCL between GPUs
//! (`dp.rs`), libtorch's Gloo between CPU processes (`gloo.rs`). Everything
//! the replicas of a drafter agree on goes through one all-reduce: who has a
//! batch, whether to stop, the averaged gradients, rank 0's weights after a
//! start, and a checksum that proves the weights identical.

use tch::{Kind, Tensor};

use crate::ModelError;

/// A reduction over the replicas.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduce {
    Sum,
    Min,
    Max,
}

/// One replica's membership in a data-parallel group. Every method is
/// collective: each rank calls it in the same order, or it fails with the
/// collective's timeout (a member that died is an error, never a hang).
pub trait Collective: Send {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// Reduces a contiguous f32 or f64 tensor over the replicas, in place,
    /// on the device the collective works on.
    fn all_reduce(&self, t: &Tensor, op: Reduce) -> Result<(), ModelError>;

    /// Like [`Collective::all_reduce`] for a wait that may last as long as
    /// another rank pauses between steps (rank 0 evaluating, snapshotting a
    /// checkpoint): a collective that can be cancelled waits without its
    /// timeout and ends only when cancelled (the generation ended, as it
    /// does when a member is lost); the others keep their timeout.
    fn all_reduce_between_steps(&self, t: &Tensor, op: Reduce) -> Result<(), ModelError> {
        self.all_reduce(t, op)
    }

    /// [`Collective::agree`] at the start of a step, through
    /// [`Collective::all_reduce_between_steps`].
    fn agree_between_steps(&self, values: &[f64], device: tch::Device) -> Result<Vec<f64>, ModelError> {
        summed(values, device, |t| self.all_reduce_between_steps(t, Reduce::Sum))
    }

    /// Minimum and maximum of an f64 value over the replicas (exact).
    fn min_max(&self, v: f64, device: tch::Device) -> Result<(f64, f64), ModelError> {
        let lo = Tensor::from_slice(&[v]).to_device(device);
        let hi = Tensor::from_slice(&[v]).to_device(device);
        self.all_reduce(&lo, Reduce::Min)?;
        self.all_reduce(&hi, Reduce::Max)?;
        Ok((lo.double_value(&[0]), hi.double_value(&[0])))
    }

    /// Sums small values over the replicas (blocking): what every replica
    /// needs to agree on before a step (who has a batch, who stops, which
    /// batch each trained). f64 holds batch ids exactly.
    fn agree(&self, values: &[f64], device: tch::Device) -> Result<Vec<f64>, ModelError> {
        summed(values, device, |t| self.all_reduce(t, Reduce::Sum))
    }

    /// Makes every replica's tensors equal to rank 0's (weights and
    /// optimizer state after a start or a resume on rank 0).
    fn broadcast_from_rank0(&self, tensors: &[Tensor]) -> Result<(), ModelError> {
        let _guard = tch::no_grad_guard();
        for t in tensors {
            // f64 carries f32 and bf16 exactly, and integer step counters too.
            let wide = if t.kind() == Kind::Double { Kind::Double } else { Kind::Float };
            let mut f = t.to_kind(wide).contiguous();
            if self.rank() != 0 {
                let _ = f.zero_();
            }
            self.all_reduce(&f, Reduce::Sum)?;
            let mut dst = t.shallow_clone();
            dst.copy_(&f);
        }
        Ok(())
    }

    /// Checks that every replica holds the same weights: the minimum and
    /// the maximum over replicas of a checksum of the parameters are equal.
    /// Returns the checksum, or an error naming the divergence.
    fn check_identical(&self, params: &[(String, Tensor)], device: tch::Device) -> Result<f64, ModelError> {
        let own = weight_checksum(params);
        let (lo, hi) = self.min_max(own, device)?;
        if lo != hi {
            return Err(ModelError::Device(format!(
                "drafter replicas diverged: weight checksums range from {lo} to {hi} (rank {} has {own})",
                self.rank()
            )));
        }
        Ok(own)
    }

    /// Replaces every gradient with its sum over the replicas divided by
    /// `contributors` (the replicas that computed one; the others hold zeros).
    fn average_gradients(&self, params: &[(String, Tensor)], contributors: f64) -> Result<(), ModelError> {
        let _guard = tch::no_grad_guard();
        let grads: Vec<Tensor> = params.iter().map(|(_, p)| p.grad()).collect();
        let mut flat = Tensor::cat(&grads.iter().map(|g| g.to_kind(Kind::Float).view([-1])).collect::<Vec<_>>(), 0);
        self.all_reduce(&flat, Reduce::Sum)?;
        // In place: a second f32 copy of every gradient would cost as much
        // device memory again (4 GiB for the Qwen3-8B-shaped drafter).
        let _ = flat.g_div_scalar_(contributors.max(1.0));
        let mut offset = 0;
        for mut g in grads {
            let n = g.numel() as i64;
            let part = flat.narrow(0, offset, n).view(g.size().as_slice()).to_kind(g.kind());
            g.copy_(&part);
            offset += n;
        }
        Ok(())
    }
}

/// `values` on `device`, summed over the replicas by `sum`, back on the host.
fn summed(
    values: &[f64],
    device: tch::Device,
    sum: impl FnOnce(&Tensor) -> Result<(), ModelError>,
) -> Result<Vec<f64>, ModelError> {
    let t = Tensor::from_slice(values).to_device(device);
    sum(&t)?;
    Ok(Vec::<f64>::try_from(&t.to_device(tch::Device::Cpu)).expect("1-D values"))
}

/// A position-weighted checksum of the parameters (swapped values change
/// it too): equal on every replica whose weights are identical.
pub fn weight_checksum(params: &[(String, Tensor)]) -> f64 {
    let _guard = tch::no_grad_guard();
    let mut own = 0f64;
    for (i, (_, p)) in params.iter().enumerate() {
        let w = Tensor::arange(p.numel() as i64, (Kind::Float, p.device())).remainder(97.0) + (i % 13) as f64;
        own += (p.to_kind(Kind::Double).view([-1]) * w.to_kind(Kind::Double)).sum(Kind::Double).double_value(&[]);
    }
    own
}
