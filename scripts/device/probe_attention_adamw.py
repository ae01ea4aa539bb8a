"""Two measurements behind choices in the drafter's training step, on an
H200 machine (a diagnosis aid, not part of the system):
  - cuDNN attention with the block mask, kv heads repeated by hand against
    grouped-query attention in the kernel (enable_gqa): time and agreement;
  - AdamW over 1.05B fp32 master weights with bf16 gradients: one op per
    term (the old optim.rs) against PyTorch's fused kernel, for scale.
    python3 scripts/device/probe_attention_adamw.py
"""
import torch, torch.nn.functional as F, time
dev, bf = "cuda", torch.bfloat16
n, G, cb, S, NH, KV, D = 3, 8, 1024, 2944, 32, 8, 128
q = torch.randn(n*G, NH, cb, D, device=dev, dtype=bf, requires_grad=True)
k = torch.randn(n*G, KV, S+cb, D, device=dev, dtype=bf, requires_grad=True)
v = torch.randn(n*G, KV, S+cb, D, device=dev, dtype=bf, requires_grad=True)
mask = torch.rand(n*G, 1, cb, S+cb, device=dev) < 0.5
mask[..., S:] = True
go = torch.randn(n*G, NH, cb, D, device=dev, dtype=bf)
def rep(gqa):
    if gqa:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), attn_mask=mask)
def timeit(gqa):
    for _ in range(3):
        o = rep(gqa); o.backward(go)
    torch.cuda.synchronize(); t = time.time()
    for _ in range(10):
        o = rep(gqa); o.backward(go)
    torch.cuda.synchronize(); return (time.time()-t)/10*1e3
torch.backends.cuda.enable_cudnn_sdp(True)
o1 = rep(False); o1.backward(go); g1 = q.grad.clone(); q.grad = None; k.grad = None; v.grad = None
try:
    o2 = rep(True); o2.backward(go); g2 = q.grad.clone(); q.grad = None; k.grad = None; v.grad = None
    print("gqa max diff out", (o1-o2).abs().max().item(), "dq", (g1-g2).abs().max().item())
    print("repeat ms", timeit(False), "gqa ms", timeit(True))
except Exception as e:
    print("gqa failed:", e)
from torch.nn.attention import sdpa_kernel, SDPBackend
for be in [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]:
    try:
        with sdpa_kernel([be]):
            print(be, "gqa ms", timeit(True))
    except Exception as e:
        print(be, "gqa failed:", str(e)[:200])
# AdamW: unfused (as optim.rs) vs fused, 1.05B fp32 master params in 60 tensors, bf16 grads
P = [torch.randn(17_500_000, device=dev) for _ in range(60)]
Gs = [torch.randn_like(p, dtype=bf) for p in P]
M = [torch.zeros_like(p) for p in P]; Vv = [torch.zeros_like(p) for p in P]
B16 = [p.to(bf) for p in P]
def unfused():
    for p, g, m, v, b in zip(P, Gs, M, Vv, B16):
        g = g.float(); p.mul_(1-1e-5); m.mul_(0.9).add_(g*0.1); v.mul_(0.999).add_(g.square()*0.001)
        d = (v/0.5).sqrt()+1e-8; p.sub_(m/d*(1e-4/0.5)); b.copy_(p)
steps = [torch.tensor(1.0, device=dev) for _ in P]
def fused():
    g32 = [g.float() for g in Gs]
    torch._fused_adamw_(P, g32, M, Vv, [], steps, lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
    torch._foreach_copy_(B16, P)
for f in [unfused, fused]:
    f(); torch.cuda.synchronize(); t = time.time()
    for _ in range(5): f()
    torch.cuda.synchronize(); print(f.__name__, "adamw ms", (time.time()-t)/5*1e3)
