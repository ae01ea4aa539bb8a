//! NCCL between drafter replicas on GPUs (one per GPU, in one process or
//! across the members of a group): all-reduce on libtorch's stream, so the
//! exchange is ordered after the backward and before the optimizer step.
//! The lockstep built on it is in `collective.rs`.

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop, sys as cu};
use cudarc::nccl::{Comm, Id, ReduceOp};
use tch::{Kind, Tensor};

use crate::ModelError;
use crate::collective::{Collective, Reduce};

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

    fn reduce<T: cudarc::nccl::NcclType>(&self, t: &Tensor, op: Reduce) -> Result<(), ModelError> {
        let mut slice = TensorSlice::<T> { t, stream: self.stream.clone(), _elem: Default::default() };
        let op = match op {
            Reduce::Sum => ReduceOp::Sum,
            Reduce::Min => ReduceOp::Min,
            Reduce::Max => ReduceOp::Max,
        };
        self.comm
            .all_reduce_in_place(&mut slice, &op)
            .map(|_| ())
            .map_err(|e| ModelError::Device(format!("NCCL all-reduce: {e:?}")))
    }
}

impl Collective for Replica {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce(&self, t: &Tensor, op: Reduce) -> Result<(), ModelError> {
        if !t.is_contiguous() || !t.device().is_cuda() {
            return Err(ModelError::Device("NCCL all-reduce needs a contiguous CUDA tensor".into()));
        }
        match t.kind() {
            Kind::Float => self.reduce::<f32>(t, op),
            Kind::Double => self.reduce::<f64>(t, op),
            k => Err(ModelError::Device(format!("NCCL all-reduce of {k:?} is not used here"))),
        }
    }
}
