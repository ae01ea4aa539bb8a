//! A drafter group rank's collective, formed over the group's store: Gloo
//! between CPU replicas, NCCL between GPU replicas (rank 0 draws the NCCL
//! unique id and hands it to the others through the store). Every rank --
//! each replica of each member, in this process or another -- calls
//! [`join`] with the same world size.

use tch::Tensor;

use crate::ModelError;
use crate::collective::{Collective, Reduce};
use crate::dp::{Cancel, ID_BYTES, NcclReplica, new_group_id};
use crate::gloo::{GlooGroup, GroupStore};

/// The store key of rank 0's NCCL unique id.
const NCCL_ID_KEY: &str = "nccl-id";

/// A GPU rank's NCCL communicator, with the store that handed out its id
/// (rank 0 serves it for as long as the group lives).
struct NcclMember {
    comm: NcclReplica,
    _store: GroupStore,
}

impl Collective for NcclMember {
    fn rank(&self) -> usize {
        self.comm.rank()
    }
    fn world(&self) -> usize {
        self.comm.world()
    }
    fn all_reduce(&self, t: &Tensor, op: Reduce) -> Result<(), ModelError> {
        self.comm.all_reduce(t, op)
    }
    fn all_reduce_between_steps(&self, t: &Tensor, op: Reduce) -> Result<(), ModelError> {
        self.comm.all_reduce_between_steps(t, op)
    }
}

/// Forms the collective of `rank` in a group of `world` over `store`
/// (collective: every rank calls it): NCCL on a GPU, Gloo on the CPU
/// (reached by the others at `own_host`). Every wait within a step is
/// bounded by the store's timeout (`group.collective_timeout_ms`); the wait
/// for the others between steps is not (rank 0 may evaluate or checkpoint
/// there) and ends when `cancel` fires, on Gloo as on NCCL. A group of one forms too: that is what
/// `dflash bench-step --collective group-of-one` measures.
pub fn join(
    store: GroupStore,
    own_host: &str,
    rank: usize,
    world: usize,
    device: tch::Device,
    cancel: Cancel,
) -> Result<Box<dyn Collective>, ModelError> {
    match device {
        tch::Device::Cuda(ordinal) => {
            let id = if rank == 0 {
                let id = new_group_id()?;
                store.set(NCCL_ID_KEY, &id)?;
                id
            } else {
                let bytes = store.get(NCCL_ID_KEY, ID_BYTES)?;
                <[u8; ID_BYTES]>::try_from(bytes.as_slice()).map_err(|_| {
                    ModelError::Device(format!("the group's NCCL id has {} bytes, not {ID_BYTES}", bytes.len()))
                })?
            };
            let comm = NcclReplica::join(&id, rank, world, ordinal, store.timeout(), cancel)?;
            Ok(Box::new(NcclMember { comm, _store: store }))
        }
        _ => Ok(Box::new(GlooGroup::join(store, own_host, rank, world, cancel)?)),
    }
}
