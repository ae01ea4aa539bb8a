"""What FP8 could win in the drafter step's linear layers (issue 40).

Times one linear layer's training work -- the forward matmul, the input
gradient and the weight gradient -- in bf16 against e4m3 forward / e5m2
gradient matmuls (`torch._scaled_mm`), with the quantization the FP8 path
must pay counted in: the absolute maximum, the scale and the casts, and the
transposed copies `_scaled_mm`'s operand layouts need. Two scalings:
per-tensor current scaling, and per-row (rowwise: the forward's rows of x
and of w; the backward per tensor). Shapes are the Qwen3-8B drafter's
projections at 8,192 and 16,384 rows (512 anchors x block 16, one or two
sequences).

Prints a table and writes JSON to $OUT/fp8-linear.json.
"""

import json
import os
import sys

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MAX = {E4M3: 448.0, E5M2: 57344.0}


def quant(t, kind, dim=None):
    """t scaled into kind's range: (t8, scale) with t ~= t8 * scale. Two
    passes over t, none in f32: the absolute maximum (a norm of order inf,
    one reduction), and the product written straight into kind."""
    if dim is None:
        amax = torch.linalg.vector_norm(t, float("inf"), dtype=torch.float32)
    else:
        amax = torch.linalg.vector_norm(t, float("inf"), dim=dim, keepdim=True, dtype=torch.float32)
    scale = amax.clamp(min=1e-12) / MAX[kind]
    t8 = torch.empty(t.shape, dtype=kind, device=t.device)
    torch.mul(t, scale.reciprocal(), out=t8)
    return t8, scale


def bf16_step(x, w, g):
    y = x @ w.t()
    gx = g @ w
    gw = g.t() @ x
    return y, gx, gw


def fp8_step(x, w, g, rowwise):
    # forward: y = x w^T; mat2 must be column-major: w8.t() of a row-major w8
    if rowwise:
        x8, sx = quant(x, E4M3, dim=1)  # [M, 1]
        w8, sw = quant(w, E4M3, dim=1)  # [N, 1]
        y = torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw.t(), out_dtype=torch.bfloat16)
        # the backward per tensor (rowwise scales do not transpose)
        xs, sxt = quant(x, E4M3)
        ws, swt = quant(w, E4M3)
    else:
        x8, sx = quant(x, E4M3)
        w8, sw = quant(w, E4M3)
        y = torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)
        xs, sxt, ws, swt = x8, sx, w8, sw
    g8, sg = quant(g, E5M2)
    # grad_x = g w: [M,N] x [N,K]; mat2 column-major = (w^T contiguous)^T
    wt = ws.t().contiguous()
    gx = torch._scaled_mm(g8, wt.t(), scale_a=sg, scale_b=swt, out_dtype=torch.bfloat16)
    # grad_w = g^T x: [N,M] x [M,K]; mat1 row-major g^T, mat2 column-major x
    gt = g8.t().contiguous()
    xt = xs.t().contiguous()
    gw = torch._scaled_mm(gt, xt.t(), scale_a=sg, scale_b=sxt, out_dtype=torch.bfloat16)
    return y, gx, gw


def timed(fn, iters=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main():
    torch.manual_seed(0)
    dev = "cuda"
    shapes = [  # (name, in K, out N)
        ("q_proj", 4096, 4096),
        ("k_proj|v_proj", 4096, 1024),
        ("o_proj", 4096, 4096),
        ("gate|up", 4096, 12288),
        ("down", 12288, 4096),
    ]
    rows = [8192, 16384]
    out = []
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'layer':<14}{'rows':>7}{'bf16 ms':>9}{'fp8 t ms':>9}{'fp8 r ms':>9}{'x t':>6}{'x r':>6}"
          f"{'err y t':>9}{'err gx t':>9}{'err gw t':>9}{'err y r':>9}")
    for name, k, n in shapes:
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            w = (torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k**-0.5)
            g = torch.randn(m, n, device=dev, dtype=torch.bfloat16) * 1e-3
            ref = bf16_step(x, w, g)
            t_b = timed(lambda: bf16_step(x, w, g))
            ft = fp8_step(x, w, g, False)
            t_t = timed(lambda: fp8_step(x, w, g, False))
            fr = fp8_step(x, w, g, True)
            t_r = timed(lambda: fp8_step(x, w, g, True))
            flops = 6 * m * k * n
            row = dict(layer=name, rows=m, k=k, n=n, bf16_ms=t_b, fp8_tensor_ms=t_t, fp8_row_ms=t_r,
                       bf16_tflops=flops / t_b / 1e9,
                       err_tensor=[rel_err(a, b) for a, b in zip(ft, ref)],
                       err_row=[rel_err(a, b) for a, b in zip(fr, ref)])
            out.append(row)
            print(f"{name:<14}{m:>7}{t_b:>9.3f}{t_t:>9.3f}{t_r:>9.3f}{t_b / t_t:>6.2f}{t_b / t_r:>6.2f}"
                  f"{row['err_tensor'][0]:>9.4f}{row['err_tensor'][1]:>9.4f}{row['err_tensor'][2]:>9.4f}"
                  f"{row['err_row'][0]:>9.4f}")
    tot = {key: sum(r[key] for r in out if r["rows"] == 8192) for key in ("bf16_ms", "fp8_tensor_ms", "fp8_row_ms")}
    print(f"one layer at 8192 rows: bf16 {tot['bf16_ms']:.2f} ms, fp8 tensorwise {tot['fp8_tensor_ms']:.2f} ms "
          f"({tot['bf16_ms'] / tot['fp8_tensor_ms']:.2f}x), rowwise {tot['fp8_row_ms']:.2f} ms "
          f"({tot['bf16_ms'] / tot['fp8_row_ms']:.2f}x)  [k/v counted once]")
    # The matmuls alone, without quantization: the ceiling.
    m, k, n = 8192, 4096, 12288
    a8 = torch.randn(m, k, device=dev).to(E4M3)
    b8 = torch.randn(n, k, device=dev).to(E4M3)
    one = torch.ones((), device=dev)
    t8 = timed(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    a, b = a8.to(torch.bfloat16), b8.to(torch.bfloat16)
    t16 = timed(lambda: a @ b.t())
    print(f"bare matmul {m}x{k}x{n}: bf16 {t16:.3f} ms ({2 * m * k * n / t16 / 1e9:.0f} TFLOP/s), "
          f"fp8 {t8:.3f} ms ({2 * m * k * n / t8 / 1e9:.0f} TFLOP/s)")
    json.dump(dict(device=torch.cuda.get_device_name(), rows=out, bare=dict(bf16_ms=t16, fp8_ms=t8)),
              open(os.path.join(os.environ.get("OUT", "."), "fp8-linear.json"), "w"), indent=1)


if __name__ == "__main__":
    sys.exit(main())
