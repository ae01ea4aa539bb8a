//! How the allocator treats freed memory in the roles that move hidden
//! states.
//!
//! The data plane allocates and frees MiB-sized buffers at GB/s: HTTP/2
//! read buffers that stay referenced until their chunk has landed, and
//! message buffers. glibc serves an allocation above its mmap threshold
//! (128 KiB at start, raised as such blocks are freed) with a fresh
//! mapping and unmaps it when freed, and trims the heap's free top: each
//! reuse then costs a page fault and a zeroed page per 4 KiB, and each
//! unmapping a TLB shootdown on every core that runs the process. On a
//! 16-core host that cut one hidden-state stream to 0.85-1.4 GB/s
//! (BENCHMARKS.md, transport). Serving blocks up to 32 MiB from the heap
//! and never trimming it keeps freed memory mapped for reuse; what stays
//! mapped is bounded by the peak in use, which the bounded queues, windows
//! and pools bound.

/// Applies the settings above, unless the operator set glibc's malloc
/// tunables (`GLIBC_TUNABLES`) themselves. The roles call it when they serve
/// on GPUs, where hidden states move at GB/s; a CPU run moves a few MB/s and
/// keeps glibc's defaults (on 2 cores the CPU drafter's step measured 2-21%
/// slower with this setting, BENCHMARKS.md).
pub fn keep_freed_memory_mapped() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        if std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("malloc.")) {
            return;
        }
        // The largest threshold glibc accepts on 64-bit hosts.
        const MMAP_THRESHOLD: libc::c_int = 32 << 20;
        // SAFETY: mallopt only sets allocator parameters; it is thread-safe.
        let ok = unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, libc::c_int::MAX) == 1
        };
        if !ok {
            tracing::warn!("glibc refused the allocator settings (mallopt); freed buffers may be unmapped");
        }
    }
}
