"""Where the drafter's split block attention spends GPU time (diagnosis aid).

Replays, with PyTorch on the same libtorch kernels, what
common/models/csrc/split_attention.cpp does for one layer of one micro-batch
(3 sequences of 2,900/1,800/1,300 tokens, 512 anchors, block 16, Qwen3-8B
heads), next to the chunked-mask cuDNN attention it replaces, and variants
of the per-block part. Prints times per phase and the top kernels.
    python3 scripts/device/profile_split_attention.py
"""

import torch
import torch.nn.functional as F

from gpu_timing import elapsed_ms, kernel_times

torch.manual_seed(0)
dev, bf = "cuda", torch.bfloat16
NH, KV, D, B, A = 32, 8, 128, 16, 512
LENS = [2900, 1800, 1300]
S = -(-max(LENS) // 128) * 128
n, Q = len(LENS), A * B
T = n * Q
SCALE = D ** -0.5
anchors = [sorted(torch.randperm(l - 2)[:A].add(1).tolist()) for l in LENS]


def plan(group):
    pa = dict(rows=[], cu_q=[0], cu_k=[0], max_q=group * B, max_k=0)
    pb = dict(rows=[], cu_q=[0], cu_k=[0], max_q=B, max_k=0)
    for i in range(n):
        for g in range(A // group):
            blocks = range(g * group, (g + 1) * group)
            p = min(anchors[i][j] for j in blocks)
            pa["rows"] += [i * S + t for t in range(p)]
            pa["cu_q"].append(pa["cu_q"][-1] + group * B)
            pa["cu_k"].append(pa["cu_k"][-1] + p)
            pa["max_k"] = max(pa["max_k"], p)
            for j in blocks:
                a = anchors[i][j]
                own = n * S + i * Q + j * B
                pb["rows"] += [i * S + t for t in range(p, a)] + list(range(own, own + B))
                pb["cu_q"].append(pb["cu_q"][-1] + B)
                pb["cu_k"].append(pb["cu_k"][-1] + a - p + B)
                pb["max_k"] = max(pb["max_k"], a - p + B)
    for d in (pa, pb):
        d["rows"] = torch.tensor(d["rows"], device=dev)
        d["cu_q"] = torch.tensor(d["cu_q"], device=dev, dtype=torch.int32)
        d["cu_k"] = torch.tensor(d["cu_k"], device=dev, dtype=torch.int32)
    return pa, pb


def fwd(q, k_all, v_all, p):
    k, v = k_all.index_select(0, p["rows"]), v_all.index_select(0, p["rows"])
    return torch.ops.aten._flash_attention_forward(q, k, v, p["cu_q"], p["cu_k"], p["max_q"], p["max_k"], 0.0,
                                                   False, False, scale=SCALE)


def bwd(do, q, k_all, v_all, out, lse, p, rng, unused):
    k, v = k_all.index_select(0, p["rows"]), v_all.index_select(0, p["rows"])
    return torch.ops.aten._flash_attention_backward(do, q, k, v, out, lse, p["cu_q"], p["cu_k"], p["max_q"],
                                                    p["max_k"], 0.0, False, rng, unused, scale=SCALE)


def split(q, kc, vc, kb, vb, do, parts, marks=None):
    pa, pb = parts
    k_all, v_all = torch.cat([kc, kb]), torch.cat([vc, vb])
    oa, la, ra, ua, _ = fwd(q, k_all, v_all, pa)
    ob, lb, rb, ub, _ = fwd(q, k_all, v_all, pb)
    la = la.masked_fill(la == float("inf"), float("-inf"))
    lb = lb.masked_fill(lb == float("inf"), float("-inf"))
    m = torch.logaddexp(la, lb)
    wa, wb = (la - m).exp().t().unsqueeze(-1), (lb - m).exp().t().unsqueeze(-1)
    out = (oa.float() * wa + ob.float() * wb).to(bf)
    if marks is not None:
        marks.append(torch.cuda.Event(enable_timing=True)); marks[-1].record()
    dk = torch.zeros(k_all.shape, device=dev, dtype=torch.float32)
    dv = torch.zeros(v_all.shape, device=dev, dtype=torch.float32)
    dq = None
    for p, r, u in ((pa, ra, ua), (pb, rb, ub)):
        g = bwd(do, q, k_all, v_all, out, m, p, r, u)
        dq = g[0].float() if dq is None else dq.add_(g[0].float())
        dk.index_add_(0, p["rows"], g[1].float())
        dv.index_add_(0, p["rows"], g[2].float())
    return out, dq.to(bf), dk.to(bf), dv.to(bf)


def fold_plan(parts):
    """The plan with each query row repeated for the 4 query heads of a kv head."""
    out = []
    for p in parts:
        f = dict(p)
        f["cu_q"] = p["cu_q"] * (NH // KV)
        f["max_q"] = p["max_q"] * (NH // KV)
        out.append(f)
    return out


def fold(x):  # [T, NH, D] -> [T*G, KV, D], row t*G + g, head kv (q head kv*G + g)
    return x.view(-1, KV, NH // KV, D).transpose(1, 2).reshape(-1, KV, D)


def unfold(x):
    return x.view(-1, NH // KV, KV, D).transpose(1, 2).reshape(-1, NH, D)


def split_folded(q, kc, vc, kb, vb, do, parts):
    pa, pb = parts
    k_all, v_all = torch.cat([kc, kb]), torch.cat([vc, vb])
    qf = fold(q)
    oa, la, ra, ua, _ = fwd(qf, k_all, v_all, pa)
    ob, lb, rb, ub, _ = fwd(qf, k_all, v_all, pb)
    la = la.masked_fill(la == float("inf"), float("-inf"))
    lb = lb.masked_fill(lb == float("inf"), float("-inf"))
    m = torch.logaddexp(la, lb)
    out_f = torch.lerp(oa, ob, (lb - m).exp().t().unsqueeze(-1).to(bf))
    out = unfold(out_f)
    dof = fold(do)
    dk = torch.zeros(k_all.shape, device=dev, dtype=torch.float32)
    dv = torch.zeros(v_all.shape, device=dev, dtype=torch.float32)
    dq = None
    for p, r, u in ((pa, ra, ua), (pb, rb, ub)):
        g = bwd(dof, qf, k_all, v_all, out_f, m, p, r, u)
        dq = g[0] if dq is None else dq.add_(g[0])
        dk.index_add_(0, p["rows"], g[1].float())
        dv.index_add_(0, p["rows"], g[2].float())
    return out, unfold(dq), dk.to(bf), dv.to(bf)


def masked_setup(chunk):
    G, cb = A // chunk, chunk * B
    an = torch.tensor(anchors, device=dev)
    qb = torch.arange(cb, device=dev) // B
    aq = an.view(n, G, chunk)[:, :, qb]
    sees_ctx = torch.arange(S, device=dev).view(1, 1, 1, S) < aq.unsqueeze(-1)
    sees_blk = (qb.unsqueeze(1) == qb.unsqueeze(0)).view(1, 1, cb, cb).expand(n, G, cb, cb)
    return G, cb, torch.cat([sees_ctx, sees_blk], -1).view(n * G, 1, cb, S + cb)


def masked(q, kc, vc, kb, vb, do, setup):
    G, cb, mask = setup
    qq = q.view(n * G, cb, NH, D).transpose(1, 2)

    def keys(c, b):
        c = c.view(n, 1, S, KV, D).expand(n, G, S, KV, D).reshape(n * G, S, KV, D)
        return torch.cat([c, b.view(n * G, cb, KV, D)], 1).transpose(1, 2)

    o = F.scaled_dot_product_attention(qq, keys(kc, kb), keys(vc, vb), attn_mask=mask, enable_gqa=True)
    o = o.transpose(1, 2).reshape(T, NH, D)
    o.backward(do)
    return o


def leaf(rows, h):
    return torch.randn(rows, h, D, device=dev, dtype=bf).requires_grad_()


q, kc, vc, kb, vb = leaf(T, NH), leaf(n * S, KV), leaf(n * S, KV), leaf(T, KV), leaf(T, KV)
do = torch.randn(T, NH, D, device=dev, dtype=bf)
raw = [t.detach() for t in (q, kc, vc, kb, vb)]


def timed(name, fn, reps=5):
    print(f"{name:<44} {elapsed_ms(fn, reps):8.2f} ms (forward + backward, one layer)")


def main():
    torch.backends.cuda.enable_cudnn_sdp(True)
    print(f"one micro-batch: {n} sequences {LENS}, S={S}, {A} anchors, block {B}; {NH}/{KV} heads, head_dim {D}")
    for chunk in (64, 32):
        st = masked_setup(chunk)
        timed(f"masked cuDNN, chunk {chunk}", lambda: masked(q, kc, vc, kb, vb, do, st))
    for group in (8, 16, 32, 64):
        parts = plan(group)
        print(f"  group {group}: prefix keys {parts[0]['rows'].numel():,}, band keys {parts[1]['rows'].numel():,}")
        timed(f"split, group {group}", lambda: split(*raw, do, parts))
        fparts = fold_plan(parts)
        timed(f"split folded, group {group}", lambda: split_folded(*raw, do, fparts))
        if group == 16:
            a, b = split(*raw, do, parts), split_folded(*raw, do, fparts)
            print("  folded vs unfolded, max |diff| of out, dq, dk, dv:",
                  [f"{(x.float() - y.float()).abs().max().item():.3g}" for x, y in zip(a, b)])

    # Phases of the split at group 16.
    parts = plan(16)
    pa, pb = parts
    k_all = torch.cat([raw[1], raw[3]])
    v_all = torch.cat([raw[2], raw[4]])
    fa, fb = fwd(raw[0], k_all, v_all, pa), fwd(raw[0], k_all, v_all, pb)
    print("lse shapes:", tuple(fa[1].shape), tuple(fb[1].shape))
    m = torch.logaddexp(fa[1], fb[1])
    out = fa[0]
    timed("  part A forward (gather + flash)", lambda: fwd(raw[0], k_all, v_all, pa))
    timed("  part B forward (gather + flash)", lambda: fwd(raw[0], k_all, v_all, pb))
    timed("  part A backward (gather + flash)", lambda: bwd(do, raw[0], k_all, v_all, out, m, pa, fa[2], fa[3]))
    timed("  part B backward (gather + flash)", lambda: bwd(do, raw[0], k_all, v_all, out, m, pb, fb[2], fb[3]))
    ka = k_all.index_select(0, pa["rows"])
    timed("  part A gather of k", lambda: k_all.index_select(0, pa["rows"]))
    gk = torch.randn(ka.shape, device=dev, dtype=bf)
    timed("  part A index_add of dk (fp32)",
          lambda: torch.zeros(k_all.shape, device=dev, dtype=torch.float32).index_add_(0, pa["rows"], gk.float()))

    kernels = kernel_times(lambda: split_folded(*raw, do, fold_plan(parts)))
    total = sum(v[0] for v in kernels.values())
    print(f"split folded, group 16: GPU kernel time {total / 1e3:.2f} ms; top kernels:")
    for name, (t, c) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:14]:
        print(f"  {t / 1e3:7.2f} ms x{c:<3} {name[:100]}")


if __name__ == "__main__":
    main()
