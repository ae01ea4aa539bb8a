"""GPU timing helpers shared by the device diagnosis scripts (run them from
the repository root as `python3 scripts/device/<script>.py`; this folder is
then on the import path)."""

import torch
from torch.profiler import ProfilerActivity, profile


def elapsed_ms(fn, reps=5):
    """GPU milliseconds per call of `fn`, after two warm-up calls."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / reps


def kernel_times(fn):
    """{kernel name: [GPU microseconds, calls]} over one profiled call of `fn`."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(e.name, [0.0, 0])
            kernels[e.name][0] += e.time_range.elapsed_us()
            kernels[e.name][1] += 1
    return kernels
