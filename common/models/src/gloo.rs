//! A drafter group's rendezvous and CPU collectives, from libtorch itself:
//! PyTorch's TCPStore (rank 0 serves it, the others connect) and its Gloo
//! process group on top (`csrc/gloo_group.cpp`). GPU groups use the same
//! store to hand rank 0's NCCL unique id to the others.

use std::ffi::{CString, c_char, c_void};
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use tch::{Kind, Tensor};

use crate::ModelError;
use crate::collective::{Collective, Reduce};
use crate::dp::Cancel;

unsafe extern "C" {
    fn dflash_group_open_store(
        host: *const c_char,
        port: i32,
        serve: bool,
        world: i32,
        timeout_ms: i64,
        err: *mut c_char,
        err_len: i32,
    ) -> *mut c_void;
    fn dflash_group_store_port(g: *mut c_void) -> i32;
    fn dflash_group_init_gloo(
        g: *mut c_void,
        prefix: *const c_char,
        own_host: *const c_char,
        rank: i32,
        world: i32,
        timeout_ms: i64,
        err: *mut c_char,
        err_len: i32,
    ) -> i32;
    fn dflash_group_all_reduce(g: *mut c_void, t: *mut c_void, op: i32, err: *mut c_char, err_len: i32) -> i32;
    fn dflash_group_store_set(
        g: *mut c_void,
        prefix: *const c_char,
        key: *const c_char,
        data: *const u8,
        len: usize,
        err: *mut c_char,
        err_len: i32,
    ) -> i32;
    fn dflash_group_store_get(
        g: *mut c_void,
        prefix: *const c_char,
        key: *const c_char,
        out: *mut u8,
        cap: usize,
        len: *mut usize,
        err: *mut c_char,
        err_len: i32,
    ) -> i32;
    fn dflash_group_store_add(
        g: *mut c_void,
        prefix: *const c_char,
        key: *const c_char,
        delta: i64,
        value: *mut i64,
        err: *mut c_char,
        err_len: i32,
    ) -> i32;
    fn dflash_group_free(g: *mut c_void);
}

const ERR_LEN: usize = 1024;

fn message(err: &[u8]) -> String {
    let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
    // libtorch's messages carry a C++ backtrace after the first line.
    String::from_utf8_lossy(&err[..end]).lines().next().unwrap_or("").to_string()
}

fn c_string(what: &str, s: &str) -> Result<CString, ModelError> {
    CString::new(s).map_err(|_| ModelError::Device(format!("{what} {s:?} contains a NUL byte")))
}

/// Opens the store: served for `world` members, or reached at `host:port`.
fn open_store(host: &str, port: u16, world: Option<usize>, timeout: Duration) -> Result<*mut c_void, String> {
    let h = CString::new(host).map_err(|_| format!("host {host:?} contains a NUL byte"))?;
    let mut err = [0u8; ERR_LEN];
    // SAFETY: `h` and `err` outlive the call; `err`'s length is passed.
    let raw = unsafe {
        dflash_group_open_store(
            h.as_ptr(),
            i32::from(port),
            world.is_some(),
            world.unwrap_or(0) as i32,
            timeout.as_millis() as i64,
            err.as_mut_ptr().cast(),
            ERR_LEN as i32,
        )
    };
    if raw.is_null() { Err(message(&err)) } else { Ok(raw) }
}

/// The group's key-value store (PyTorch's TCPStore): served by rank 0,
/// reached by every member. Keys live under the group's generation.
pub struct GroupStore {
    raw: *mut c_void,
    generation: CString,
    timeout: Duration,
    /// Where the store listens (`host:port`).
    pub address: String,
}

// SAFETY: the store is used by one thread at a time (the member's train
// thread owns it); TCPStore itself is thread-safe.
unsafe impl Send for GroupStore {}

impl GroupStore {
    /// Rank 0: serves the store on `host` at a free port.
    pub fn serve(host: &str, world: usize, generation: u64, timeout: Duration) -> Result<Self, ModelError> {
        let raw = open_store(host, 0, Some(world), timeout)
            .map_err(|e| ModelError::Device(format!("serving the group's store on {host}: {e}")))?;
        // SAFETY: `raw` is the live store just created.
        let port = unsafe { dflash_group_store_port(raw) };
        Self::wrap(raw, generation, timeout, format!("{host}:{port}"))
    }

    /// Other ranks: connects to rank 0's store at `address` (`host:port`).
    pub fn connect(address: &str, generation: u64, timeout: Duration) -> Result<Self, ModelError> {
        let (host, port) = address
            .rsplit_once(':')
            .and_then(|(h, p)| Some((h, p.parse::<u16>().ok()?)))
            .ok_or_else(|| ModelError::Device(format!("group store address {address:?} is not host:port")))?;
        let raw = open_store(host, port, None, timeout)
            .map_err(|e| ModelError::Device(format!("reaching the group's store at {address}: {e}")))?;
        Self::wrap(raw, generation, timeout, address.to_string())
    }

    /// How long every wait on the store, and on the collectives formed over
    /// it, may take (`group.collective_timeout_ms`).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn wrap(raw: *mut c_void, generation: u64, timeout: Duration, address: String) -> Result<Self, ModelError> {
        let generation = CString::new(format!("gen-{generation}")).expect("digits hold no NUL");
        Ok(Self { raw, generation, timeout, address })
    }

    /// Publishes a small value for the other members.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), ModelError> {
        let k = c_string("key", key)?;
        let mut err = [0u8; ERR_LEN];
        // SAFETY: every pointer outlives the call; lengths are passed.
        let rc = unsafe {
            dflash_group_store_set(
                self.raw,
                self.generation.as_ptr(),
                k.as_ptr(),
                value.as_ptr(),
                value.len(),
                err.as_mut_ptr().cast(),
                ERR_LEN as i32,
            )
        };
        if rc != 0 {
            return Err(ModelError::Device(format!("group store set {key}: {}", message(&err))));
        }
        Ok(())
    }

    /// Waits (at most the store's timeout) for a value another member set.
    pub fn get(&self, key: &str, max_len: usize) -> Result<Vec<u8>, ModelError> {
        let k = c_string("key", key)?;
        let mut err = [0u8; ERR_LEN];
        let mut out = vec![0u8; max_len];
        let mut len = 0usize;
        // SAFETY: `out` has `max_len` bytes; the shim copies at most that.
        let rc = unsafe {
            dflash_group_store_get(
                self.raw,
                self.generation.as_ptr(),
                k.as_ptr(),
                out.as_mut_ptr(),
                max_len,
                &mut len,
                err.as_mut_ptr().cast(),
                ERR_LEN as i32,
            )
        };
        if rc != 0 {
            return Err(ModelError::Device(format!(
                "group store get {key} (waited up to {} ms): {}",
                self.timeout.as_millis(),
                message(&err)
            )));
        }
        if len > max_len {
            return Err(ModelError::Device(format!("group store value {key} has {len} bytes, expected {max_len}")));
        }
        out.truncate(len);
        Ok(out)
    }
}

impl GroupStore {
    /// Adds `delta` to the shared counter `key` and returns its new value
    /// (0 reads it); never waits for another member.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64, ModelError> {
        let k = c_string("key", key)?;
        let mut err = [0u8; ERR_LEN];
        let mut value = 0i64;
        // SAFETY: every pointer outlives the call.
        let rc = unsafe {
            dflash_group_store_add(
                self.raw,
                self.generation.as_ptr(),
                k.as_ptr(),
                delta,
                &mut value,
                err.as_mut_ptr().cast(),
                ERR_LEN as i32,
            )
        };
        if rc != 0 {
            return Err(ModelError::Device(format!("group store add {key}: {}", message(&err))));
        }
        Ok(value)
    }
}

impl Drop for GroupStore {
    fn drop(&mut self) {
        // SAFETY: `raw` came from the shim and is freed once, here.
        unsafe { dflash_group_free(self.raw) }
    }
}

/// The store counter of the ranks' arrivals at between-steps collectives.
const ARRIVALS_KEY: &str = "between-steps-arrivals";

/// A member of a CPU group: libtorch's Gloo process group over the store.
pub struct GlooGroup {
    store: GroupStore,
    rank: usize,
    world: usize,
    cancel: Cancel,
    /// Between-steps collectives this rank has entered.
    between: AtomicI64,
}

impl GlooGroup {
    /// Forms the group (collective: every rank calls it). Gloo listens on
    /// the interface `own_host` resolves to; every collective fails after
    /// `timeout` if a member does not take part. A wait between steps
    /// ends early when `cancel` says so.
    pub fn join(
        store: GroupStore,
        own_host: &str,
        rank: usize,
        world: usize,
        cancel: Cancel,
    ) -> Result<Self, ModelError> {
        let h = c_string("host", own_host)?;
        let mut err = [0u8; ERR_LEN];
        // SAFETY: every pointer outlives the call; the store is live.
        let rc = unsafe {
            dflash_group_init_gloo(
                store.raw,
                store.generation.as_ptr(),
                h.as_ptr(),
                rank as i32,
                world as i32,
                store.timeout.as_millis() as i64,
                err.as_mut_ptr().cast(),
                ERR_LEN as i32,
            )
        };
        if rc != 0 {
            return Err(ModelError::Device(format!(
                "forming the Gloo group (rank {rank} of {world}, store {}): {}",
                store.address,
                message(&err)
            )));
        }
        Ok(Self { store, rank, world, cancel, between: AtomicI64::new(0) })
    }

    /// Waits, without the collective timeout, until every rank has entered
    /// this rank's current between-steps collective: each adds one to a
    /// shared counter and polls it (1 ms, doubling to 20 ms). Gloo's own
    /// timeout would count rank 0's work between steps (an evaluation, a
    /// checkpoint) against the others, and a Gloo timeout breaks the group.
    /// Ends with an error when `cancel` fires.
    fn wait_for_arrivals(&self) -> Result<(), ModelError> {
        let n = self.between.fetch_add(1, Ordering::Relaxed) + 1;
        let everyone = n * self.world as i64;
        let mut arrived = self.store.add(ARRIVALS_KEY, 1)?;
        let mut pause = Duration::from_millis(1);
        while arrived < everyone {
            if (self.cancel)() {
                return Err(ModelError::Device(format!(
                    "Gloo group (rank {} of {}): cancelled while waiting for the others between steps ({} of {} arrived)",
                    self.rank,
                    self.world,
                    arrived - (n - 1) * self.world as i64,
                    self.world
                )));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(20));
            arrived = self.store.add(ARRIVALS_KEY, 0)?;
        }
        Ok(())
    }

    pub fn store(&self) -> &GroupStore {
        &self.store
    }
}

impl Collective for GlooGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn all_reduce_between_steps(&self, t: &Tensor, op: Reduce) -> Result<(), ModelError> {
        self.wait_for_arrivals()?;
        self.all_reduce(t, op)
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce(&self, t: &Tensor, op: Reduce) -> Result<(), ModelError> {
        if !t.is_contiguous() || t.device() != tch::Device::Cpu || !matches!(t.kind(), Kind::Float | Kind::Double) {
            return Err(ModelError::Device("Gloo all-reduce needs a contiguous f32 or f64 CPU tensor".into()));
        }
        let op = match op {
            Reduce::Sum => 0,
            Reduce::Min => 1,
            Reduce::Max => 2,
        };
        let mut err = [0u8; ERR_LEN];
        // SAFETY: `t` is a live at::Tensor for the call; Gloo writes its
        // storage in place, which the caller lent for exactly that.
        let rc = unsafe {
            dflash_group_all_reduce(
                self.store.raw,
                t.as_ptr() as *mut c_void,
                op,
                err.as_mut_ptr().cast(),
                ERR_LEN as i32,
            )
        };
        if rc != 0 {
            return Err(ModelError::Device(format!(
                "Gloo all-reduce (rank {} of {}): {}",
                self.rank,
                self.world,
                message(&err)
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three ranks as threads of one process: the real store, the real
    /// Gloo group, over loopback TCP.
    #[test]
    fn three_ranks_sum_agree_and_broadcast() {
        let timeout = Duration::from_secs(20);
        let store0 = GroupStore::serve("127.0.0.1", 3, 7, timeout).unwrap();
        let address = store0.address.clone();
        let mut stores = vec![store0];
        for _ in 1..3 {
            stores.push(GroupStore::connect(&address, 7, timeout).unwrap());
        }
        stores[0].set("hello", b"from rank 0").unwrap();
        assert_eq!(stores[2].get("hello", 64).unwrap(), b"from rank 0");
        let threads: Vec<_> = stores
            .into_iter()
            .enumerate()
            .map(|(rank, store)| {
                std::thread::spawn(move || {
                    let g = GlooGroup::join(store, "127.0.0.1", rank, 3, crate::dp::never_cancelled()).unwrap();
                    let t = Tensor::from_slice(&[rank as f32, 1.0]);
                    g.all_reduce(&t, Reduce::Sum).unwrap();
                    let sum = Vec::<f32>::try_from(&t).unwrap();
                    let (lo, hi) = g.min_max(rank as f64 * 1.5, tch::Device::Cpu).unwrap();
                    let w = Tensor::from_slice(&[rank as f32 + 10.0; 4]);
                    g.broadcast_from_rank0(std::slice::from_ref(&w)).unwrap();
                    (sum, lo, hi, Vec::<f32>::try_from(&w).unwrap())
                })
            })
            .collect();
        for t in threads {
            let (sum, lo, hi, w) = t.join().unwrap();
            assert_eq!(sum, vec![3.0, 3.0]);
            assert_eq!((lo, hi), (0.0, 3.0));
            assert_eq!(w, vec![10.0; 4]);
        }
    }

    #[test]
    fn a_member_that_leaves_fails_the_next_collective_instead_of_hanging_it() {
        let timeout = Duration::from_secs(5);
        let store0 = GroupStore::serve("127.0.0.1", 2, 3, timeout).unwrap();
        let store1 = GroupStore::connect(&store0.address, 3, timeout).unwrap();
        let leaver = std::thread::spawn(move || {
            let g = GlooGroup::join(store1, "127.0.0.1", 1, 2, crate::dp::never_cancelled()).unwrap();
            g.all_reduce(&Tensor::from_slice(&[1f32]), Reduce::Sum).unwrap();
            // Dropped: its connections close, as a killed process's do.
        });
        let g = GlooGroup::join(store0, "127.0.0.1", 0, 2, crate::dp::never_cancelled()).unwrap();
        g.all_reduce(&Tensor::from_slice(&[1f32]), Reduce::Sum).unwrap();
        leaver.join().unwrap();
        let t0 = std::time::Instant::now();
        let err = g.all_reduce(&Tensor::from_slice(&[1f32]), Reduce::Sum).expect_err("rank 1 is gone");
        assert!(t0.elapsed() < Duration::from_secs(30), "took {:?}", t0.elapsed());
        assert!(err.to_string().contains("Gloo all-reduce (rank 0 of 2)"), "{err}");
    }

    /// Rank 0 works between steps for longer than the collective timeout
    /// (an evaluation, a checkpoint): the others wait for it, then the
    /// step's collective runs; a wait that is cancelled ends with an error.
    #[test]
    fn a_pause_between_steps_longer_than_the_timeout_is_waited_for_and_can_be_cancelled() {
        let timeout = Duration::from_millis(1500);
        let store0 = GroupStore::serve("127.0.0.1", 2, 5, timeout).unwrap();
        let store1 = GroupStore::connect(&store0.address, 5, timeout).unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let seen = stop.clone();
        let other = std::thread::spawn(move || {
            let cancel: Cancel = std::sync::Arc::new(move || seen.load(Ordering::Relaxed));
            let g = GlooGroup::join(store1, "127.0.0.1", 1, 2, cancel).unwrap();
            let mut sums = Vec::new();
            for _ in 0..2 {
                let t = Tensor::from_slice(&[1f32]);
                g.all_reduce_between_steps(&t, Reduce::Sum).unwrap();
                sums.push(f32::try_from(&t).unwrap());
            }
            let t0 = std::time::Instant::now();
            let err = g.all_reduce_between_steps(&Tensor::from_slice(&[1f32]), Reduce::Sum).expect_err("cancelled");
            (sums, t0.elapsed(), err.to_string())
        });
        let g = GlooGroup::join(store0, "127.0.0.1", 0, 2, crate::dp::never_cancelled()).unwrap();
        for pause in [3000, 2000] {
            std::thread::sleep(Duration::from_millis(pause));
            let t = Tensor::from_slice(&[2f32]);
            g.all_reduce_between_steps(&t, Reduce::Sum).unwrap();
            assert_eq!(f32::try_from(&t).unwrap(), 3.0);
        }
        std::thread::sleep(Duration::from_millis(500));
        stop.store(true, Ordering::Relaxed);
        let (sums, waited, err) = other.join().unwrap();
        assert_eq!(sums, vec![3.0, 3.0]);
        assert!(waited < Duration::from_secs(5), "cancel took {waited:?}");
        assert!(err.contains("cancelled while waiting for the others between steps (1 of 2 arrived)"), "{err}");
    }

    #[test]
    fn a_member_that_never_comes_is_an_error_after_the_timeout() {
        let store = GroupStore::serve("127.0.0.1", 2, 1, Duration::from_millis(1500)).unwrap();
        let t0 = std::time::Instant::now();
        let err =
            GlooGroup::join(store, "127.0.0.1", 0, 2, crate::dp::never_cancelled()).err().expect("rank 1 never joins");
        assert!(t0.elapsed() < Duration::from_secs(30), "took {:?}", t0.elapsed());
        assert!(err.to_string().contains("forming the Gloo group"), "{err}");
    }
}
