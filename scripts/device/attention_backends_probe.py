"""Issue 40 (32K step): the split attention's two parts, timed with each
variable-length kernel libtorch has -- flash (FlashAttention-2, what
csrc/split_attention.cpp calls) and cuDNN's ragged SDPA -- on the shapes of
one 32K-token sequence with 512 anchors, block 16, chunk 32 (Qwen3-8B heads:
32 query heads over 8 kv heads, folded into rows as the drafter does).

Not yet run: no device started in the session that wrote it.

Prints, per part and kernel: forward and backward ms, TFLOP/s, and the
largest difference of output and log-sum-exp against flash. Writes JSON.
  python3 attention_backends_probe.py OUT.json [SEQ_LEN] [ANCHORS]
"""

import json
import random
import sys

import torch

aten = torch.ops.aten


def plan(seq_len, anchors, block, chunk, fold):
    """cu_seqlens of part A (each group's prefix) and part B (each block's
    rest of the context plus its own slots), rows folded by `fold`."""
    rng = random.Random(0)
    a = sorted(rng.sample(range(1, seq_len - block), anchors))
    groups = [a[g * chunk:(g + 1) * chunk] for g in range(anchors // chunk)]
    prefix_q, prefix_k, band_q, band_k = [], [], [], []
    for grp in groups:
        p = grp[0]
        prefix_q.append(chunk * block * fold)
        prefix_k.append(p)
        for x in grp:
            band_q.append(block * fold)
            band_k.append(x - p + block)
    return (prefix_q, prefix_k), (band_q, band_k)


def cu(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device="cuda")


def timed(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        out = fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps, out


def part(name, lengths, heads, d, scale):
    ql, kl = lengths
    tq, tk = sum(ql), sum(kl)
    mq, mk = max(ql), max(kl)
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(tq, heads, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(tk, heads, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(tk, heads, d, device="cuda", dtype=torch.bfloat16, generator=g)
    do = torch.randn_like(q)
    cq, ck = cu(ql), cu(kl)
    flops = 4 * sum(a * b for a, b in zip(ql, kl)) * heads * d
    rows = {}

    def flash_fwd():
        return aten._flash_attention_forward(q, k, v, cq, ck, mq, mk, 0.0, False, False, scale=scale)

    ms, (o_f, lse_f, rng, unused, _) = timed(flash_fwd)
    bms, _ = timed(lambda: aten._flash_attention_backward(do, q, k, v, o_f, lse_f, cq, ck, mq, mk, 0.0, False,
                                                          rng, unused, scale=scale))
    rows["flash"] = {"fwd_ms": ms, "bwd_ms": bms}
    print(f"{name}: flash lse {tuple(lse_f.shape)}", flush=True)
    try:
        def cudnn_fwd():
            return aten._cudnn_attention_forward(q, k, v, None, cq, ck, mq, mk, True, 0.0, False, False,
                                                 scale=scale)

        ms, r = timed(cudnn_fwd)
        o_c, lse_c, seed, offset = r[0], r[1], r[6], r[7]
        print(f"{name}: cudnn lse {tuple(lse_c.shape)} stride {lse_c.stride()}", flush=True)
        diff = (o_c.float() - o_f.float()).abs().max().item()
        lf = lse_f if lse_f.dim() == 2 else None
        lse_diff = None
        if lf is not None:
            lc = lse_c.reshape(-1, heads).t() if lse_c.numel() == lf.numel() else None
            if lc is not None:
                lse_diff = (lc.float() - lf[:, :tq].float()).abs().max().item()
        bms, grads = timed(lambda: aten._cudnn_attention_backward(do, q, k, v, o_c, lse_c, seed, offset,
                                                                  None, cq, ck, mq, mk,
                                                                  0.0, False, scale=scale))
        _, fgrads = timed(lambda: aten._flash_attention_backward(do, q, k, v, o_f, lse_f, cq, ck, mq, mk, 0.0,
                                                                 False, rng, unused, scale=scale), reps=1)
        gdiff = [(a.float() - b.float()).abs().max().item() for a, b in zip(grads, fgrads)]
        rows["cudnn"] = {"fwd_ms": ms, "bwd_ms": bms, "out_diff": diff, "lse_diff": lse_diff, "grad_diff": gdiff}
    except Exception as e:  # noqa: BLE001 -- report what libtorch refused
        rows["cudnn"] = {"error": str(e)[:400]}
    for kern, r in rows.items():
        if "fwd_ms" in r:
            r["fwd_tflops"] = flops / r["fwd_ms"] / 1e9
            r["bwd_tflops"] = 2.5 * flops / r["bwd_ms"] / 1e9
        print(f"{name} {kern}: {r}", flush=True)
    return {"seqs": len(ql), "q_rows": tq, "k_rows": tk, "gflop_fwd": flops / 1e9, "kernels": rows}


def main():
    out = sys.argv[1]
    seq_len = int(sys.argv[2]) if len(sys.argv) > 2 else 32768
    anchors = int(sys.argv[3]) if len(sys.argv) > 3 else 512
    print(torch.__version__, torch.backends.cudnn.version(), torch.cuda.get_device_name(), flush=True)
    a, b = plan(seq_len, anchors, 16, 32, 4)
    res = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
           "gpu": torch.cuda.get_device_name(), "seq_len": seq_len, "anchors": anchors}
    res["prefix"] = part("prefix", a, 8, 128, 128 ** -0.5)
    res["band"] = part("band", b, 8, 128, 128 ** -0.5)
    json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
