//! Data-parallel drafters: one replica per GPU in one process, gradients
//! averaged with NCCL all-reduce on libtorch's stream (so the exchange is
//! ordered after the backward and before the optimizer step), and a small
//! agreement all-reduce that keeps the replicas in lockstep.

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop, sys as cu};
use cudarc::nccl::{Comm, Id, ReduceOp};
use tch::{Kind, Tensor};

use crate::ModelError;

/// A contiguous CUDA tensor seen as a cudarc device slice of `T`.
struct TensorSlice<'t, T> {
    t: &'t Tensor,
    stream: Arc<CudaStream>,
    _elem: std::marker::PhantomData<T>,
}

impl<T> DeviceSlice<T> for TensorSlice<'_, T> {
    fn len(&self) -> usize {
        self.t.numel()
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> DevicePtr<T> for TensorSlice<'_, T> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (cu::CUdeviceptr, SyncOnDrop<'a>) {
        (self.t.data_ptr() as cu::CUdeviceptr, SyncOnDrop::Sync(None))
    }
}

impl<T> DevicePtrMut<T> for TensorSlice<'_, T> {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (cu::CUdeviceptr, SyncOnDrop<'a>) {
        (self.t.data_ptr() as cu::CUdeviceptr, SyncOnDrop::Sync(None))
    }
}

/// A new NCCL group id (created once, shared by every replica).
pub fn new_group_id() -> Result<Id, ModelError> {
    Id::new().map_err(|e| ModelError::Device(format!("NCCL unique id: {e:?}")))
}

/// One replica's membership in the data-parallel group.
pub struct Replica {
    comm: Comm,
    stream: Arc<CudaStream>,
    pub rank: usize,
    pub world: usize,
}

// SAFETY: the communicator is used by the one thread that owns the replica.
unsafe impl Send for Replica {}

impl Replica {
    /// Joins the group on GPU `ordinal`; every rank must call this
    /// concurrently (NCCL initialisation is collective).
    pub fn join(id: Id, rank: usize, world: usize, ordinal: usize) -> Result<Self, ModelError> {
        let ctx = crate::gpu::context(ordinal)?;
        let stream = crate::gpu::torch_stream(&ctx);
        let comm = Comm::from_rank(stream.clone(), rank, world, id)
            .map_err(|e| ModelError::Device(format!("NCCL init of rank {rank}/{world} on GPU {ordinal}: {e:?}")))?;
        Ok(Self { comm, stream, rank, world })
    }

    /// Sums a contiguous f32 CUDA tensor over the replicas, in place.
    pub fn all_reduce_sum(&self, t: &Tensor) -> Result<(), ModelError> {
        assert!(t.kind() == Kind::Float && t.is_contiguous(), "all-reduce needs a contiguous f32 tensor");
        let mut slice = TensorSlice::<f32> { t, stream: self.stream.clone(), _elem: Default::default() };
        self.comm
            .all_reduce_in_place(&mut slice, &ReduceOp::Sum)
            .map(|_| ())
            .map_err(|e| ModelError::Device(format!("NCCL all-reduce: {e:?}")))
    }

    /// Minimum and maximum of an f64 value over the replicas (exact).
    fn min_max(&self, v: f64, device: tch::Device) -> Result<(f64, f64), ModelError> {
        let mut out = [0f64; 2];
        for (i, op) in [ReduceOp::Min, ReduceOp::Max].iter().enumerate() {
            let t = Tensor::from_slice(&[v]).to_device(device);
            let mut slice = TensorSlice::<f64> { t: &t, stream: self.stream.clone(), _elem: Default::default() };
            self.comm
                .all_reduce_in_place(&mut slice, op)
                .map_err(|e| ModelError::Device(format!("NCCL all-reduce: {e:?}")))?;
            out[i] = t.double_value(&[0]);
        }
        Ok((out[0], out[1]))
    }

    /// Sums small flags over the replicas (blocking): what every replica
    /// needs to agree on before a step (who has a batch, who stops).
    pub fn agree(&self, flags: &[f32], device: tch::Device) -> Result<Vec<f32>, ModelError> {
        let t = Tensor::from_slice(flags).to_device(device);
        self.all_reduce_sum(&t)?;
        Ok(Vec::<f32>::try_from(&t.to_device(tch::Device::Cpu)).expect("1-D flags"))
    }

    /// Makes every replica's tensors equal to rank 0's (weights and
    /// optimizer state after a start or a resume on the leader).
    pub fn broadcast_from_rank0(&self, tensors: &[Tensor]) -> Result<(), ModelError> {
        let _guard = tch::no_grad_guard();
        for t in tensors {
            let mut f = t.to_kind(Kind::Float).contiguous();
            if self.rank != 0 {
                let _ = f.zero_();
            }
            self.all_reduce_sum(&f)?;
            let mut dst = t.shallow_clone();
            dst.copy_(&f);
        }
        Ok(())
    }

    /// Checks that every replica holds the same weights: the minimum and
    /// the maximum over replicas of a checksum of the parameters are equal.
    /// Returns the checksum, or an error naming the divergence.
    pub fn check_identical(&self, params: &[(String, Tensor)], device: tch::Device) -> Result<f64, ModelError> {
        let _guard = tch::no_grad_guard();
        // Position-weighted so that swapped values change the checksum too.
        let mut own = 0f64;
        for (i, (_, p)) in params.iter().enumerate() {
            let w = Tensor::arange(p.numel() as i64, (Kind::Float, p.device())).remainder(97.0) + (i % 13) as f64;
            own += (p.to_kind(Kind::Double).view([-1]) * w.to_kind(Kind::Double)).sum(Kind::Double).double_value(&[]);
        }
        let (lo, hi) = self.min_max(own, device)?;
        if lo != hi {
            return Err(ModelError::Device(format!(
                "drafter replicas diverged: weight checksums range from {lo} to {hi} (rank {} has {own})",
                self.rank
            )));
        }
        Ok(own)
    }

    /// Replaces every gradient with its sum over the replicas divided by
    /// `contributors` (the replicas that computed one; the others hold zeros).
    pub fn average_gradients(&self, params: &[(String, Tensor)], contributors: f32) -> Result<(), ModelError> {
        let _guard = tch::no_grad_guard();
        let grads: Vec<Tensor> = params.iter().map(|(_, p)| p.grad()).collect();
        let flat = Tensor::cat(&grads.iter().map(|g| g.to_kind(Kind::Float).view([-1])).collect::<Vec<_>>(), 0);
        self.all_reduce_sum(&flat)?;
        let flat = flat / f64::from(contributors.max(1.0));
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
