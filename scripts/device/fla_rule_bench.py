"""The gated delta rule alone, as flash-linear-attention 0.6.0 computes it
(chunked Triton kernels over packed sequences, cu_seqlens): the time one
linear-attention layer's rule takes at a given shape, the yardstick for
ours. Prints ms per call (median of CUDA-event timings).

    PYTHONPATH=<fla wheels> python3 scripts/device/fla_rule_bench.py --heads 48 --dim 128 --lens 3000,2500,2048,1900,1552
"""
import argparse

import torch
import torch.nn.functional as F
from fla.ops.gated_delta_rule import chunk_gated_delta_rule

ap = argparse.ArgumentParser()
ap.add_argument("--heads", type=int, default=48)
ap.add_argument("--dim", type=int, default=128)
ap.add_argument("--lens", default="3000,2500,2048,1900,1552")
a = ap.parse_args()
lens = [int(x) for x in a.lens.split(",")]
t, h, d = sum(lens), a.heads, a.dim
dev = "cuda"
torch.manual_seed(0)
q = F.normalize(torch.randn(1, t, h, d, device=dev), dim=-1).bfloat16()
k = F.normalize(torch.randn(1, t, h, d, device=dev), dim=-1).bfloat16()
v = torch.randn(1, t, h, d, device=dev).bfloat16()
g = -F.softplus(torch.randn(1, t, h, device=dev)) * 0.5
beta = torch.rand(1, t, h, device=dev).sigmoid()
cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=dev, dtype=torch.int32)
with torch.no_grad():
    for _ in range(3):
        chunk_gated_delta_rule(q, k, v, g, beta, scale=d**-0.5, cu_seqlens=cu)
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        chunk_gated_delta_rule(q, k, v, g, beta, scale=d**-0.5, cu_seqlens=cu)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
times.sort()
print(f"fla chunk_gated_delta_rule: {t} tokens, {h} heads x {d}: {times[len(times)//2]:.2f} ms (median of 10)")
