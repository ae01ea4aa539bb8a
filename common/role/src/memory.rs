//! The process's allocator: jemalloc, for Rust's allocations and, through
//! its unprefixed `malloc`/`free` (which the executable exports ahead of
//! glibc's), for libtorch's too.
//!
//! Why not glibc's: a CPU drafter's resident memory crept 4.5-8.7 MiB/min
//! (30- and 5-minute soaks, BENCHMARKS.md) while heaptrack found nothing of
//! ours live and `malloc_trim` returned 4 MB: the growth was fragmentation
//! in one glibc arena, where a step's short-lived tensors and the few
//! long-lived allocations made meanwhile interleave. The same build with
//! jemalloc preloaded stayed flat (-0.001 MiB/min). On GPU hosts glibc also
//! had to be told to keep freed MiB-sized buffers mapped (mmap threshold
//! 32 MiB, no trimming): at GB/s, unmapping and faulting them in again cut
//! one hidden-state stream to 0.85-1.4 GB/s. jemalloc keeps freed extents
//! (retained, returned to the OS only after its decay time), so the data
//! plane reuses them without page faults and no setting is needed.

#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;
