"""Where the drafter's training step spends GPU time, by kernel.

A diagnosis aid, not part of the system: it replays the op sequence of
`Trainer::micro_batch` (common/models/src/trainer.rs, drafter.rs) with
PyTorch on the same libtorch kernels, for the benchmark's shapes
(Qwen3-8B-shaped 5-layer drafter, block 16, 512 anchors, chunks of 64
blocks, context padded to a multiple of 128, cuDNN attention), and prints
the GPU time per kernel and per kind of kernel. Run on an H200 machine:
    python3 scripts/device/profile_drafter_step.py [out.json]
"""

import json
import sys

import torch
import torch.nn.functional as F

torch.manual_seed(0)
dev, bf = "cuda", torch.bfloat16
H, NH, KV, D, I, V = 4096, 32, 8, 128, 12288, 151936
LAYERS, K, B, ANCHORS, CHUNK = 5, 5, 16, 512, 64
LENS = [2900, 1800, 1300]  # one micro-batch of the benchmark's mix
S = -(-max(LENS) // 128) * 128
n, Q = len(LENS), ANCHORS * B


def param(*shape, scale=0.02):
    return (torch.randn(*shape, device=dev, dtype=bf) * scale).requires_grad_()


fc = param(H, K * H)
hidden_norm = torch.ones(H, device=dev, dtype=bf, requires_grad=True)
layers = []
for _ in range(LAYERS):
    layers.append(dict(
        ln1=torch.ones(H, device=dev, dtype=bf, requires_grad=True),
        ln2=torch.ones(H, device=dev, dtype=bf, requires_grad=True),
        qn=torch.ones(D, device=dev, dtype=bf, requires_grad=True),
        kn=torch.ones(D, device=dev, dtype=bf, requires_grad=True),
        q=param(NH * D, H), k=param(KV * D, H), v=param(KV * D, H), o=param(H, NH * D),
        g=param(I, H), u=param(I, H), d=param(H, I)))
final_norm = torch.ones(H, device=dev, dtype=bf, requires_grad=True)
embed = torch.randn(V, H, device=dev, dtype=bf) * 0.02
lm_head = torch.randn(V, H, device=dev, dtype=bf) * 0.02
params = [fc, hidden_norm, final_norm] + [p for l in layers for p in l.values()]

inv_freq = 1.0 / (1e6 ** (torch.arange(0, D, 2, device=dev, dtype=torch.float32) / D))


def cos_sin(pos):
    f = pos.float().unsqueeze(-1) * inv_freq
    e = torch.cat([f, f], -1)
    return e.cos().to(bf), e.sin().to(bf)


def rope(x, c, s):
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return x * c + torch.cat([-x2, x1], -1) * s


def rms(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, 1e-6)


# Anchors, block ids and the chunked mask as BlockLayout builds them.
anchors = torch.stack([torch.sort(torch.randperm(l - 2, device=dev)[:ANCHORS])[0] for l in LENS])  # [n, A]
G = ANCHORS // CHUNK
cbk = CHUNK * B
q_block = torch.arange(cbk, device=dev) // B
anchor_of_q = anchors.view(n, G, CHUNK)[:, :, q_block]  # [n, G, CB]
sees_ctx = torch.arange(S, device=dev).view(1, 1, 1, S) < anchor_of_q.unsqueeze(-1)
sees_blk = (q_block.unsqueeze(1) == q_block.unsqueeze(0)).view(1, 1, cbk, cbk).expand(n, G, cbk, cbk)
mask = torch.cat([sees_ctx, sees_blk], -1).view(n * G, 1, cbk, S + cbk)
block_pos = (anchors.unsqueeze(-1) + torch.arange(B, device=dev)).view(n, Q)
block_ids = torch.randint(0, V, (n, Q), device=dev)
features = torch.randn(sum(LENS), K * H, device=dev, dtype=bf)
rows = torch.arange(n * Q, device=dev).view(-1, B)[:, 1:].reshape(-1)
labels = torch.randint(0, V, (rows.numel(),), device=dev)
weights = torch.rand(rows.numel(), device=dev)


def layer_forward(p, x, ctx, rp):
    xn = rms(x, p["ln1"])
    q = rope(rms((xn @ p["q"].T).view(n, Q, NH, D), p["qn"]), rp["bc"], rp["bs"]).view(n * G, cbk, NH, D).transpose(1, 2)
    kc = rope(rms((ctx @ p["k"].T).view(n, S, KV, D), p["kn"]), rp["cc"], rp["cs"])
    kb = rope(rms((xn @ p["k"].T).view(n, Q, KV, D), p["kn"]), rp["bc"], rp["bs"])
    vc = (ctx @ p["v"].T).view(n, S, KV, D)
    vb = (xn @ p["v"].T).view(n, Q, KV, D)

    def keys(c, b):
        c = c.unsqueeze(1).expand(n, G, S, KV, D).reshape(n * G, S, KV, D)
        k = torch.cat([c, b.reshape(n * G, cbk, KV, D)], 1).transpose(1, 2)
        return k.repeat_interleave(NH // KV, 1)

    o = F.scaled_dot_product_attention(q, keys(kc, kb), keys(vc, vb), attn_mask=mask)
    x = x + o.transpose(1, 2).reshape(n, Q, NH * D) @ p["o"].T
    h = rms(x, p["ln2"])
    return x + (F.silu(h @ p["g"].T) * (h @ p["u"].T)) @ p["d"].T


def step():
    padded = torch.zeros(n, S, K * H, device=dev, dtype=bf)
    off = 0
    for i, l in enumerate(LENS):
        padded[i, :l] = features[off:off + l]
        off += l
    ctx = rms(padded @ fc.T, hidden_norm)
    cc, cs = cos_sin(torch.arange(S, device=dev))
    bc, bs = cos_sin(block_pos)
    rp = dict(cc=cc.unsqueeze(1), cs=cs.unsqueeze(1), bc=bc.unsqueeze(2), bs=bs.unsqueeze(2))
    x = embed[block_ids]
    for p in layers:
        x = layer_forward(p, x, ctx, rp)
    hidden = rms(x, final_norm)
    r = hidden.view(-1, H)[rows]
    det = r.detach().requires_grad_()
    chunk = 256 * (B - 1)
    for s in range(0, r.shape[0], chunk):
        logits = (det[s:s + chunk] @ lm_head.T).float()
        ce = F.cross_entropy(logits, labels[s:s + chunk], reduction="none")
        ((ce * weights[s:s + chunk]).sum() / 1e4).backward()
        logits.argmax(-1)
    (r * det.grad).sum().backward()
    for p in params:
        p.grad = None


torch.backends.cuda.enable_cudnn_sdp(True)
for _ in range(3):
    step()
torch.cuda.synchronize()
ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
ev0.record()
for _ in range(3):
    step()
ev1.record()
torch.cuda.synchronize()
print(f"micro-batch of {n} sequences {LENS} (S={S}), {ANCHORS} anchors, chunk {CHUNK}: "
      f"{ev0.elapsed_time(ev1) / 3:.1f} ms per micro-batch (forward + backward, no optimizer)")

from gpu_timing import kernel_times  # noqa: E402

kernels = kernel_times(step)


def kind(name):
    nm = name.lower()
    for k, pats in [("attention", ["fmha", "flash", "cudnn", "attention", "sdpa"]),
                    ("matmul", ["gemm", "nvjet", "cutlass", "sm90_xmma", "cublas"]),
                    ("softmax/CE", ["softmax", "nll", "cross_entropy", "log_softmax"]),
                    ("copy/cat/index", ["copy", "cat", "index", "gather", "scatter", "repeat", "fill", "memcpy", "memset"]),
                    ("reduce", ["reduce", "norm", "sum", "mean", "argmax"])]:
        if any(p in nm for p in pats):
            return k
    return "elementwise/other"


total = sum(v[0] for v in kernels.values())
by_kind = {}
for name, (t, c) in kernels.items():
    by_kind.setdefault(kind(name), 0.0)
    by_kind[kind(name)] += t
print(f"GPU kernel time in one profiled micro-batch: {total / 1e3:.1f} ms")
for k, t in sorted(by_kind.items(), key=lambda kv: -kv[1]):
    print(f"  {k:<20} {t / 1e3:8.1f} ms {100 * t / total:5.1f}%")
print("top kernels:")
for name, (t, c) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:25]:
    print(f"  {t / 1e3:8.1f} ms {100 * t / total:5.1f}% x{c:<4} {name[:110]}")
if len(sys.argv) > 1:
    json.dump({"total_us": total, "by_kind_us": by_kind,
               "kernels": {k: v for k, v in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:60]}},
              open(sys.argv[1], "w"), indent=1)
