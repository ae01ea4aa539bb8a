"""Probe: libtorch's cuDNN attention with variable-length sequences
(`_cudnn_attention_forward/backward` with cum_seq_q/cum_seq_k) against the
flash calls the split attention makes, on the split's part A shapes (folded
grouped-query heads). Prints agreement, the log-sum-exp layout and times."""

import sys

import torch


# The plan and shapes of profile_split_attention.py (importing it runs none of its benchmarks).
from gpu_timing import elapsed_ms  # noqa: E402
from profile_split_attention import SCALE, T, do, fold, fold_plan, plan, raw  # noqa: E402,F401

pa, pb = fold_plan(plan(16))
q = fold(raw[0])
k_all = torch.cat([raw[1], raw[3]])
v_all = torch.cat([raw[2], raw[4]])
for name, p in (("A", pa), ("B", pb)):
    k, v = k_all.index_select(0, p["rows"]), v_all.index_select(0, p["rows"])
    f = torch.ops.aten._flash_attention_forward(q, k, v, p["cu_q"], p["cu_k"], p["max_q"], p["max_k"], 0.0, False, False, scale=SCALE)
    try:
        c = torch.ops.aten._cudnn_attention_forward(q, k, v, None, p["cu_q"], p["cu_k"], p["max_q"], p["max_k"], True, 0.0, False, False, scale=SCALE)
    except Exception as e:  # noqa: BLE001
        print(f"part {name}: cuDNN varlen failed: {str(e)[:300]}")
        continue
    print(f"part {name}: out {tuple(c[0].shape)} lse {tuple(c[1].shape)} (flash lse {tuple(f[1].shape)}); "
          f"max |out diff| {(c[0].float() - f[0].float()).abs().max().item():.3g}")
    lse = c[1].reshape(-1) if c[1].numel() == f[1].numel() else None
    if lse is not None:
        for cand, t in (("[H,T]", c[1].reshape(f[1].shape)), ("[T,H]", c[1].reshape(f[1].shape[1], -1).t())):
            print(f"   lse as {cand}: max diff {(t - f[1]).abs().max().item():.3g}")

    def timed(fn):
        return elapsed_ms(fn, reps=10)

    dof = fold(do)
    ff = lambda: torch.ops.aten._flash_attention_forward(q, k, v, p["cu_q"], p["cu_k"], p["max_q"], p["max_k"], 0.0, False, False, scale=SCALE)  # noqa: E731
    cf = lambda: torch.ops.aten._cudnn_attention_forward(q, k, v, None, p["cu_q"], p["cu_k"], p["max_q"], p["max_k"], True, 0.0, False, False, scale=SCALE)  # noqa: E731
    fb = lambda: torch.ops.aten._flash_attention_backward(dof, q, k, v, f[0], f[1], p["cu_q"], p["cu_k"], p["max_q"], p["max_k"], 0.0, False, f[2], f[3], scale=SCALE)  # noqa: E731
    try:
        cb = lambda: torch.ops.aten._cudnn_attention_backward(dof, q, k, v, c[0], c[1], c[6], c[7], torch.Tensor(), p["cu_q"], p["cu_k"], p["max_q"], p["max_k"], 0.0, False, scale=SCALE)  # noqa: E731
        gf, gc = fb(), cb()
        print("   backward max |diff| dq, dk, dv:", [f"{(a.float() - b.float()).abs().max().item():.3g}" for a, b in zip(gf, gc)])
        print(f"   ms: flash fwd {timed(ff):.2f} bwd {timed(fb):.2f}; cuDNN fwd {timed(cf):.2f} bwd {timed(cb):.2f}")
    except Exception as e:  # noqa: BLE001
        print(f"   cuDNN varlen backward failed: {str(e)[:300]}")
        print(f"   ms: flash fwd {timed(ff):.2f}; cuDNN fwd {timed(cf):.2f}")
sys.exit(0)
