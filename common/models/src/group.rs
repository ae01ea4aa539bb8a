//! A drafter group member's collective, formed over the group's store:
//! Gloo between CPU processes, NCCL between GPUs (rank 0 draws the NCCL
//! unique id and hands it to the others through the store). Every member
//! calls [`join`] with the same world size.

use tch::Tensor;

use crate::ModelError;
use crate::collective::{Collective, Reduce};
use crate::dp::{Replica, new_group_id};
use crate::gloo::{GlooGroup, GroupStore};

/// The store key of rank 0's NCCL unique id.
const NCCL_ID_KEY: &str = "nccl-id";
/// Bytes of an NCCL unique id (`NCCL_UNIQUE_ID_BYTES`).
const NCCL_ID_BYTES: usize = 128;

/// A GPU member's NCCL communicator, with the store that handed out its id
/// (rank 0 serves it for as long as the group lives).
struct NcclMember {
    comm: Replica,
    _store: GroupStore,
}

impl Collective for NcclMember {
    fn rank(&self) -> usize {
        self.comm.rank
    }
    fn world(&self) -> usize {
        self.comm.world
    }
    fn all_reduce(&self, t: &Tensor, op: Reduce) -> Result<(), ModelError> {
        self.comm.all_reduce(t, op)
    }
}

/// Forms the collective of `rank` in a group of `world` over `store`
/// (collective: every member calls it): NCCL on a GPU, Gloo on the CPU
/// (reached by the others at `own_host`). A group of one forms too: that
/// is what `dflash bench-step --group-of-one` measures.
pub fn join(
    store: GroupStore,
    own_host: &str,
    rank: usize,
    world: usize,
    device: tch::Device,
) -> Result<Box<dyn Collective>, ModelError> {
    match device {
        tch::Device::Cuda(ordinal) => {
            let id = if rank == 0 {
                let id = new_group_id()?;
                let bytes: Vec<u8> = id.internal().iter().map(|&c| c as u8).collect();
                store.set(NCCL_ID_KEY, &bytes)?;
                id
            } else {
                let bytes = store.get(NCCL_ID_KEY, NCCL_ID_BYTES)?;
                if bytes.len() != NCCL_ID_BYTES {
                    return Err(ModelError::Device(format!(
                        "the group's NCCL id has {} bytes, not {NCCL_ID_BYTES}",
                        bytes.len()
                    )));
                }
                let mut internal = [0 as std::ffi::c_char; NCCL_ID_BYTES];
                for (d, b) in internal.iter_mut().zip(bytes) {
                    *d = b as std::ffi::c_char;
                }
                cudarc::nccl::Id::uninit(internal)
            };
            let comm = Replica::join(id, rank, world, ordinal)?;
            Ok(Box::new(NcclMember { comm, _store: store }))
        }
        _ => Ok(Box::new(GlooGroup::join(store, own_host, rank, world)?)),
    }
}
