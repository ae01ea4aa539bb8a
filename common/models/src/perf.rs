//! Measuring the device for benchmarks: the dense matmul rate that MFU is
//! relative to, and synchronization for wall-clock timing.

use std::time::Instant;

use tch::{Device, Kind, Tensor};

/// Waits for all queued work on `device`.
pub fn sync_device(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

/// Measured dense matmul rate (FLOP/s) on random data: the MFU denominator
/// (8192^3 on GPUs, 1024^3 on CPUs).
pub fn matmul_peak(device: Device, kind: Kind) -> f64 {
    let _guard = tch::no_grad_guard();
    let n: i64 = if device.is_cuda() { 8192 } else { 1024 };
    let a = Tensor::randn([n, n], (kind, device));
    let b = Tensor::randn([n, n], (kind, device));
    for _ in 0..3 {
        let _ = a.matmul(&b);
    }
    sync_device(device);
    let iters = if device.is_cuda() { 20 } else { 5 };
    let t0 = Instant::now();
    for _ in 0..iters {
        let _ = a.matmul(&b);
    }
    sync_device(device);
    2.0 * (n * n * n) as f64 * iters as f64 / t0.elapsed().as_secs_f64()
}
