"""Where the time of one MoE block goes on a GPU (random bf16 weights),
stage by stage, for the block as common/models/src/moe.rs computes it and
for variants of its un-permute step. CUDA events, median of repeated runs.
Shapes: Qwen3-30B-A3B (10,000 tokens, 128 experts of 768) by default;
`qwen3.5-35b-a3b` (8,134 tokens, 256 experts of 512).

    python3 scripts/device/profile_moe.py [qwen3.5-35b-a3b]
"""
import sys

import torch



def elapsed_ms(f, repeats=20):
    """Median GPU time of f() in ms (CUDA events, after two warm-up calls)."""
    for _ in range(2):
        f()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        f()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


SHAPES = {"qwen3-30b-a3b": (10_000, 2048, 128, 8, 768), "qwen3.5-35b-a3b": (8_134, 2048, 256, 8, 512)}
T, H, E, K, I = SHAPES[sys.argv[1] if len(sys.argv) > 1 else "qwen3-30b-a3b"]
dev, bf = "cuda", torch.bfloat16
torch.manual_seed(0)
x = torch.randn(T, H, device=dev, dtype=bf)
router = torch.randn(E, H, device=dev, dtype=bf) * 0.02
gate_up = torch.randn(E, 2 * I, H, device=dev, dtype=bf) * 0.02
down = torch.randn(E, H, I, device=dev, dtype=bf) * 0.02


def route():
    probs = torch.softmax(x @ router.T, -1, dtype=torch.float)
    w, chosen = probs.topk(K, -1)
    w = (w / w.sum(-1, keepdim=True)).to(bf)
    flat = chosen.reshape(-1)
    _, order = flat.sort(stable=True)
    counts = torch.zeros(E, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    return w, order, counts.cumsum(0, dtype=torch.int32)


w, order, offs = route()
token = order // K
rows = x.index_select(0, token)


def experts(rows):
    gu = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs)
    g, u = gu.chunk(2, -1)
    return torch._grouped_mm(torch.nn.functional.silu(g) * u, down.transpose(1, 2), offs)


out = experts(rows)
act = torch.randn(T * K, I, device=dev, dtype=bf)
inverse = torch.empty_like(order)
inverse[order] = torch.arange(order.numel(), device=dev)


def index_add():
    o = out * w.reshape(-1).index_select(0, order).unsqueeze(-1)
    return torch.zeros_like(x).index_add(0, token, o)


def gather_sum():
    return (out.index_select(0, inverse).view(T, K, H) * w.unsqueeze(-1)).sum(1)


def gather_bmm():
    return torch.bmm(w.unsqueeze(1), out.index_select(0, inverse).view(T, K, H)).squeeze(1)


ref = index_add().float()
for f in (gather_sum, gather_bmm):
    err = ((f().float() - ref).abs().max() / ref.abs().max()).item()
    print(f"{f.__name__} vs index_add: {err:.2e}")

stages = {
    "router + softmax + topk + sort + offsets": route,
    "gather rows": lambda: x.index_select(0, token),
    "grouped gate_up": lambda: torch._grouped_mm(rows, gate_up.transpose(1, 2), offs),
    "experts (2 grouped GEMMs + act)": lambda: experts(rows),
    "un-permute: index_add": index_add,
    "un-permute: gather + weighted sum": gather_sum,
    "un-permute: gather + bmm": gather_bmm,
    "grouped down": lambda: torch._grouped_mm(act, down.transpose(1, 2), offs),
    "dense reference: [T,H]x[H,2I*K] matmul (same FLOPs as gate_up)": lambda: x @ gate_up[:K].reshape(K * 2 * I, H).T,
}
flops_gu = 2 * T * K * H * 2 * I
for name, f in stages.items():
    ms = elapsed_ms(f)
    flops = flops_gu if "gate_up" in name else flops_gu / 2 if "down" in name else 0
    extra = f"  {flops / ms / 1e9:.0f} TFLOP/s" if flops else ""
    print(f"{name:<66} {ms:8.3f} ms{extra}")
