//! NCCL between drafter replicas on GPUs: one communicator per replica, a
//! rank of the drafter group whether its peers run in this process or on
//! another host. NCCL by itself waits forever: a rank that never comes
//! blocks the others' initialisation, and a rank that dies mid-step leaves
//! theirs spinning in the all-reduce kernel. So the communicator is formed
//! nonblocking, and every wait on it -- its initialisation, each
//! all-reduce's enqueue and completion -- polls the communicator's
//! asynchronous error and ends after the group's collective timeout or
//! when the caller cancels (its generation ended). The wait for the others
//! to be ready for the next step has no timeout (rank 0 may pause between
//! steps for as long as an evaluation takes); it ends when cancelled, which
//! a lost member causes through the coordinator. Then the communicator is
//! aborted (`ncclCommAbort` ends its kernels and frees the stream) and the
//! wait returns an error: the member leaves its generation instead of
//! hanging in a collective. The lockstep built on it is in `collective.rs`.

use std::ffi::CStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use cudarc::driver::CudaStream;
use cudarc::nccl::sys;
use tch::{Kind, Tensor};

use crate::ModelError;
use crate::collective::{Collective, Reduce};

/// Says whether a waiting collective should give up (the member's
/// generation ended, the role stops).
pub type Cancel = Arc<dyn Fn() -> bool + Send + Sync>;

/// A cancel that never fires (benchmarks, tests).
pub fn never_cancelled() -> Cancel {
    Arc::new(|| false)
}

/// Bytes of an NCCL unique id (`NCCL_UNIQUE_ID_BYTES`).
pub const ID_BYTES: usize = 128;

/// A new NCCL group id (drawn once by rank 0, handed to every rank).
pub fn new_group_id() -> Result<[u8; ID_BYTES], ModelError> {
    let id = cudarc::nccl::result::get_uniqueid().map_err(|e| ModelError::Device(format!("NCCL unique id: {e:?}")))?;
    Ok(id.internal.map(|c| c as u8))
}

/// One replica's NCCL communicator.
pub struct NcclReplica {
    comm: sys::ncclComm_t,
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
    timeout: Duration,
    cancel: Cancel,
    /// Set once aborted: every later call fails at once.
    aborted: AtomicBool,
}

// SAFETY: the communicator is used by the one thread that owns the replica
// (NCCL communicators may move between threads, not be shared by them).
unsafe impl Send for NcclReplica {}

/// What a wait on the communicator is waiting for.
enum Poll {
    Done,
    NotYet,
}

impl NcclReplica {
    /// Joins the group as `rank` of `world` on GPU `ordinal` (collective:
    /// every rank calls it with the same id). Fails after `timeout` if the
    /// other ranks do not all arrive, or at once when `cancel` fires.
    pub fn join(
        id: &[u8; ID_BYTES],
        rank: usize,
        world: usize,
        ordinal: usize,
        timeout: Duration,
        cancel: Cancel,
    ) -> Result<Self, ModelError> {
        let ctx = crate::gpu::context(ordinal)?;
        ctx.bind_to_thread().map_err(|e| ModelError::Device(format!("binding GPU {ordinal}: {e:?}")))?;
        let stream = crate::gpu::torch_stream(&ctx);
        let mut config = nonblocking_config();
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        let unique = sys::ncclUniqueId { internal: id.map(|b| b as std::ffi::c_char) };
        // SAFETY: `comm` and `config` outlive the call; the id is by value.
        let rc = unsafe { sys::ncclCommInitRankConfig(&mut comm, world as i32, unique, rank as i32, &mut config) };
        let what = format!("NCCL init of rank {rank} of {world} on GPU {ordinal}");
        if !matches!(rc, sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress) || comm.is_null() {
            if !comm.is_null() {
                // SAFETY: a communicator NCCL handed out, aborted once.
                unsafe { sys::ncclCommAbort(comm) };
            }
            return Err(ModelError::Device(format!("{what}: {}", describe(rc, std::ptr::null_mut()))));
        }
        let me = Self { comm, stream, rank, world, timeout, cancel, aborted: AtomicBool::new(false) };
        // Initialisation goes on in NCCL's threads until every rank came.
        me.wait(&what, Some(timeout), || Ok(Poll::Done)).map_err(|e| {
            ModelError::Device(format!(
                "{e} (every rank of the drafter group must join within group.collective_timeout_ms)"
            ))
        })?;
        Ok(me)
    }

    /// Ends the communicator's work and its kernels, once.
    fn abort(&self) {
        if !self.aborted.swap(true, Ordering::SeqCst) {
            // SAFETY: the communicator is live until Drop, which aborts only
            // if this did not.
            unsafe { sys::ncclCommAbort(self.comm) };
        }
    }

    /// The communicator's asynchronous state: Ok(true) ready, Ok(false)
    /// still in progress, Err on an NCCL error (a peer lost, a network error).
    fn state(&self) -> Result<bool, String> {
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: a live communicator; `state` outlives the call.
        let rc = unsafe { sys::ncclCommGetAsyncError(self.comm, &mut state) };
        if rc != sys::ncclResult_t::ncclSuccess {
            return Err(describe(rc, self.comm));
        }
        match state {
            sys::ncclResult_t::ncclSuccess => Ok(true),
            sys::ncclResult_t::ncclInProgress => Ok(false),
            e => Err(describe(e, self.comm)),
        }
    }

    /// Waits until the communicator is ready and `poll` says done, within
    /// `timeout` (None: without one) and until cancelled; aborts the
    /// communicator otherwise.
    fn wait(
        &self,
        what: &str,
        timeout: Option<Duration>,
        mut poll: impl FnMut() -> Result<Poll, String>,
    ) -> Result<(), ModelError> {
        let start = Instant::now();
        let mut polls = 0u32;
        loop {
            let outcome = match self.state() {
                Ok(true) => match poll() {
                    Ok(Poll::Done) => return Ok(()),
                    Ok(Poll::NotYet) => Ok(()),
                    Err(e) => Err(e),
                },
                Ok(false) => Ok(()),
                Err(e) => Err(e),
            };
            let why = match outcome {
                Err(e) => Some(e),
                Ok(()) if (self.cancel)() => Some("cancelled: the drafter group's generation ended".to_string()),
                Ok(()) if timeout.is_some_and(|t| start.elapsed() >= t) => Some(format!(
                    "no answer from the other ranks within {} ms",
                    timeout.unwrap_or_default().as_millis()
                )),
                Ok(()) => None,
            };
            if let Some(why) = why {
                self.abort();
                return Err(ModelError::Device(format!("{what}: {why}; the communicator was aborted")));
            }
            // Most waits end within a millisecond (a step's small
            // agreements): spin briefly before sleeping.
            polls += 1;
            if polls < 2000 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }

    /// Reduces `t` in place over the ranks, waiting at most `timeout`.
    fn reduce(&self, t: &Tensor, op: Reduce, timeout: Option<Duration>) -> Result<(), ModelError> {
        if !t.is_contiguous() || !t.device().is_cuda() {
            return Err(ModelError::Device("NCCL all-reduce needs a contiguous CUDA tensor".into()));
        }
        let dtype = match t.kind() {
            Kind::Float => sys::ncclDataType_t::ncclFloat32,
            Kind::Double => sys::ncclDataType_t::ncclFloat64,
            k => return Err(ModelError::Device(format!("NCCL all-reduce of {k:?} is not used here"))),
        };
        if self.aborted.load(Ordering::SeqCst) {
            return Err(ModelError::Device(format!(
                "NCCL all-reduce (rank {} of {}): the communicator was aborted",
                self.rank, self.world
            )));
        }
        let op = match op {
            Reduce::Sum => sys::ncclRedOp_t::ncclSum,
            Reduce::Min => sys::ncclRedOp_t::ncclMin,
            Reduce::Max => sys::ncclRedOp_t::ncclMax,
        };
        let what = format!("NCCL all-reduce (rank {} of {})", self.rank, self.world);
        let ptr = t.data_ptr();
        // SAFETY: `t` is a contiguous CUDA tensor of `numel` elements of
        // `dtype` that lives until this call has waited for the reduction;
        // libtorch's stream orders it after the kernels that wrote `t`.
        let rc = unsafe {
            sys::ncclAllReduce(ptr, ptr, t.numel(), dtype, op, self.comm, self.stream.cu_stream() as sys::cudaStream_t)
        };
        match rc {
            // Nonblocking: the enqueue may finish later (`state` says when).
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => {}
            e => {
                let why = describe(e, self.comm);
                self.abort();
                return Err(ModelError::Device(format!("{what}: {why}")));
            }
        }
        let mut done: Option<cudarc::driver::CudaEvent> = None;
        self.wait(&what, timeout, || {
            // Enqueued (the communicator is ready): wait for the kernel.
            let event = match &done {
                Some(e) => e,
                None => done.insert(self.stream.record_event(None).map_err(|e| format!("recording an event: {e:?}"))?),
            };
            match event.try_is_complete() {
                Ok(true) => Ok(Poll::Done),
                Ok(false) => Ok(Poll::NotYet),
                Err(e) => Err(format!("CUDA error while waiting: {e:?}")),
            }
        })
    }
}

impl Drop for NcclReplica {
    fn drop(&mut self) {
        // Abort rather than destroy: destroying waits for the peers, which
        // may be gone; the process is leaving the group either way.
        self.abort();
    }
}

impl Collective for NcclReplica {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce(&self, t: &Tensor, op: Reduce) -> Result<(), ModelError> {
        self.reduce(t, op, Some(self.timeout))
    }

    fn all_reduce_between_steps(&self, t: &Tensor, op: Reduce) -> Result<(), ModelError> {
        self.reduce(t, op, None)
    }
}

/// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`: every field NCCL_CONFIG
/// leaves undefined stays undefined (NCCL's defaults); NCCL reads at most
/// the fields its own version knows (it copies `size` bytes, capped).
fn nonblocking_config() -> sys::ncclConfig_t {
    const UNDEF: i32 = i32::MIN;
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        // NCCL_VERSION(2, 30, 0): the layout cudarc's `nccl` feature binds.
        version: 23000,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

/// An NCCL result with NCCL's own words for it, and the communicator's
/// last error message where there is one.
fn describe(rc: sys::ncclResult_t, comm: sys::ncclComm_t) -> String {
    // SAFETY: NCCL returns static NUL-terminated strings (or null).
    let text = |p: *const std::ffi::c_char| {
        if p.is_null() { String::new() } else { unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned() }
    };
    let general = text(unsafe { sys::ncclGetErrorString(rc) });
    let last = text(unsafe { sys::ncclGetLastError(comm) });
    if last.is_empty() { format!("{rc:?} ({general})") } else { format!("{rc:?} ({general}): {last}") }
}

#[cfg(test)]
mod tests {
    //! On a GPU host: `cargo test -p dflash-models --release -- --ignored nccl`
    //! (`scripts/device/nccl-waits.sh`). One GPU is enough: a rank that
    //! never comes is simply never started.

    use super::*;

    fn gpu_zero() {
        crate::cuda::ensure_cuda(&[0]).expect("libtorch_cuda");
        assert!(tch::Cuda::is_available(), "no CUDA device");
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn nccl_init_without_its_peer_fails_after_the_timeout_and_the_gpu_goes_on() {
        gpu_zero();
        let id = new_group_id().unwrap();
        let t0 = Instant::now();
        let err = NcclReplica::join(&id, 0, 2, 0, Duration::from_secs(3), never_cancelled())
            .err()
            .expect("rank 1 never joins");
        let waited = t0.elapsed();
        assert!(waited >= Duration::from_secs(3) && waited < Duration::from_secs(20), "waited {waited:?}");
        let err = err.to_string();
        assert!(err.contains("NCCL init of rank 0 of 2 on GPU 0"), "{err}");
        assert!(err.contains("within 3000 ms") && err.contains("aborted"), "{err}");
        // The abort left the device usable: a new group forms and reduces.
        let one = NcclReplica::join(&new_group_id().unwrap(), 0, 1, 0, Duration::from_secs(30), never_cancelled())
            .expect("a group of one");
        let t = Tensor::from_slice(&[1.5f32, -2.0, 4.0]).to_device(tch::Device::Cuda(0));
        one.all_reduce(&t, Reduce::Sum).unwrap();
        assert_eq!(Vec::<f32>::try_from(&t.to_device(tch::Device::Cpu)).unwrap(), vec![1.5, -2.0, 4.0]);
        assert_eq!(one.min_max(7.25, tch::Device::Cuda(0)).unwrap(), (7.25, 7.25));
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn nccl_wait_ends_at_once_when_cancelled() {
        gpu_zero();
        let t0 = Instant::now();
        let cancel: Cancel = Arc::new(move || t0.elapsed() > Duration::from_millis(500));
        let err = NcclReplica::join(&new_group_id().unwrap(), 1, 2, 0, Duration::from_secs(120), cancel)
            .err()
            .expect("rank 0 never comes");
        assert!(t0.elapsed() < Duration::from_secs(10), "took {:?}", t0.elapsed());
        assert!(err.to_string().contains("cancelled"), "{err}");
    }
}
