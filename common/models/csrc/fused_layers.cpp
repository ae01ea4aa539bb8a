// The drafter layer's rotary embedding and SwiGLU as autograd functions
// whose two directions are each one GPU kernel (csrc/fused_layers.cu), in
// place of libtorch's chains: RoPE as `x * cos + cat(-x2, x1) * sin` made
// five passes forward (a negation, a concatenation, two products, a sum)
// and as many back; SwiGLU as `silu(gate) * up` two forward and three back,
// with autograd keeping silu(gate) as well as gate and up. Here each
// direction reads its inputs once and writes its outputs once, in f32,
// rounding once; SwiGLU keeps only gate and up. The per-head QK norm and
// the RoPE after it are one function too (forward and backward one kernel
// each): the norm's output, a pass each way, is never written.
//
// The kernels are launched by the Rust side (src/fused_layers.rs registers
// the launcher): this library is built against libtorch's CPU half and
// cannot launch CUDA itself. Where the launcher declines (a shape or kind
// the kernels do not take), the same math runs as libtorch ops inside the
// same autograd function, which is also what the CPU tests check.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <atomic>
#include <cstdio>

// One call of the GPU launcher (src/fused_layers.rs reads it field by field).
struct DflashFusedLayerCall {
  // 0: RoPE forward; 1: RoPE backward; 2: SwiGLU forward; 3: SwiGLU backward;
  // 4: QK norm + RoPE forward; 5: its backward
  int32_t op;
  int32_t device;  // the CUDA ordinal
  int32_t bf16;    // 1: bf16 tensors; 0: f32
  int32_t heads;   // RoPE, norm + RoPE: heads per row
  int32_t dim;     // RoPE, norm + RoPE: head size
  int64_t rows;    // RoPE, norm + RoPE: rows of [rows, heads, dim]
  int64_t table_rows;  // RoPE, norm + RoPE: rows of the [table_rows, dim] tables; row r reads r % table_rows
  int64_t numel;   // SwiGLU: elements of each tensor
  // RoPE: a = x (or the output's gradient), b = cos, c = sin, out0 = the result.
  // SwiGLU forward: a = gate, b = up, out0 = silu(gate) * up.
  // SwiGLU backward: a = the output's gradient, b = gate, c = up, out0 = gate's gradient, out1 = up's.
  // Norm + RoPE forward: a = x, b = cos, c = sin, d = the norm's weight, out0 = the result,
  // out1 = each head vector's 1 / rms (f32 [rows * heads]).
  // Its backward: a = the output's gradient, b, c, d as forward, e = x, f = 1 / rms, out0 = x's
  // gradient, out1 = the weight gradient's partial sums (f32 [blocks, dim], one row per thread block).
  uint64_t a, b, c, out0, out1;
  uint64_t d, e, f;
  double eps;      // norm + RoPE: the norm's epsilon
  int64_t blocks;  // norm + RoPE backward: thread blocks (rows of out1)
};

typedef int32_t (*DflashFusedLayerLauncher)(const DflashFusedLayerCall* call, char* err, int32_t err_len);

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::atomic<DflashFusedLayerLauncher> launcher{nullptr};

uint64_t ptr(const at::Tensor& t) { return t.defined() ? reinterpret_cast<uint64_t>(t.data_ptr()) : 0; }

// Runs a call on the GPU; false where it cannot (the CPU, a kind the kernels
// do not take, no launcher) or the launcher declined it.
bool launch(DflashFusedLayerCall call, const at::Tensor& like) {
  const auto kind = like.scalar_type();
  const auto f = launcher.load();
  if (!like.is_cuda() || f == nullptr || (kind != at::kBFloat16 && kind != at::kFloat)) return false;
  call.device = like.get_device();
  call.bf16 = kind == at::kBFloat16;
  char err[512] = {0};
  const int32_t rc = f(&call, err, sizeof(err));
  TORCH_CHECK(rc == 0 || rc == 1, "fused layer kernel on cuda:", call.device, ": ", err);
  return rc == 0;
}

// RoPE of x [rows, heads, d] with tables [T, d] (row r reads table row r % T), as libtorch ops:
// forward  y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2 (x * cos + rotate_half(x) * sin);
// backward g1 c1 + g2 s2, g2 c2 - g1 s1 (its transpose).
at::Tensor rope_ops(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward) {
  const int64_t t = cos.size(0), heads = x.size(1), d = x.size(2), h = d / 2;
  auto xv = x.view({-1, t, heads, d});
  auto c = cos.view({1, t, 1, d}), s = sin.view({1, t, 1, d});
  auto x1 = xv.narrow(-1, 0, h), x2 = xv.narrow(-1, h, h);
  auto c1 = c.narrow(-1, 0, h), c2 = c.narrow(-1, h, h), s1 = s.narrow(-1, 0, h), s2 = s.narrow(-1, h, h);
  auto y = backward ? at::cat({x1 * c1 + x2 * s2, x2 * c2 - x1 * s1}, -1)
                    : at::cat({x1 * c1 - x2 * s1, x2 * c2 + x1 * s2}, -1);
  return y.view(x.sizes());
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward) {
  auto y = at::empty_like(x, at::MemoryFormat::Contiguous);
  DflashFusedLayerCall c{};
  c.op = backward ? 1 : 0;
  c.heads = static_cast<int32_t>(x.size(1)), c.dim = static_cast<int32_t>(x.size(2));
  c.rows = x.size(0), c.table_rows = cos.size(0);
  c.a = ptr(x), c.b = ptr(cos), c.c = ptr(sin), c.out0 = ptr(y);
  return launch(c, x) ? y : rope_ops(x, cos, sin, backward);
}

struct Rope : public torch::autograd::Function<Rope> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    return rope(x, cos, sin, false);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    return {rope(grads[0].contiguous(), s[0], s[1], true), at::Tensor(), at::Tensor()};
  }
};

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  auto out = at::empty_like(gate, at::MemoryFormat::Contiguous);
  DflashFusedLayerCall c{};
  c.op = 2, c.numel = gate.numel();
  c.a = ptr(gate), c.b = ptr(up), c.out0 = ptr(out);
  return launch(c, gate) ? out : at::silu(gate) * up;
}

struct Swiglu : public torch::autograd::Function<Swiglu> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    ctx->save_for_backward({gate, up});
    return swiglu(gate, up);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const auto &gate = s[0], &up = s[1];
    auto dy = grads[0].contiguous();
    auto d_gate = at::empty_like(gate, at::MemoryFormat::Contiguous);
    auto d_up = at::empty_like(up, at::MemoryFormat::Contiguous);
    DflashFusedLayerCall c{};
    c.op = 3, c.numel = gate.numel();
    c.a = ptr(dy), c.b = ptr(gate), c.c = ptr(up), c.out0 = ptr(d_gate), c.out1 = ptr(d_up);
    if (!launch(c, gate)) {
      d_up = dy * at::silu(gate);
      d_gate = at::silu_backward(dy * up, gate);
    }
    return {d_gate, d_up};
  }
};

// The QK norm over each head then RoPE, as libtorch ops.
at::Tensor norm_rope_ops(const at::Tensor& x, const at::Tensor& w, const at::Tensor& cos, const at::Tensor& sin,
                         double eps) {
  return rope_ops(at::rms_norm(x, {x.size(2)}, w, eps).contiguous(), cos, sin, false);
}

// Thread blocks of the backward kernel: one warp per head vector in the first
// blocks, then a grid stride; few enough that the weight gradient's partial
// sums, one row per block, stay small.
constexpr int64_t kNormRopeBlocks = 1024;

struct NormRope : public torch::autograd::Function<NormRope> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, const at::Tensor& cos,
                            const at::Tensor& sin, double eps) {
    auto y = at::empty_like(x, at::MemoryFormat::Contiguous);
    auto rstd = at::empty({x.size(0) * x.size(1)}, x.options().dtype(at::kFloat));
    DflashFusedLayerCall c{};
    c.op = 4;
    c.heads = static_cast<int32_t>(x.size(1)), c.dim = static_cast<int32_t>(x.size(2));
    c.rows = x.size(0), c.table_rows = cos.size(0), c.eps = eps;
    c.a = ptr(x), c.b = ptr(cos), c.c = ptr(sin), c.d = ptr(w), c.out0 = ptr(y), c.out1 = ptr(rstd);
    if (!launch(c, x)) {
      y = norm_rope_ops(x, w, cos, sin, eps);
      rstd = at::Tensor();  // the backward recomputes through the ops
    }
    ctx->save_for_backward({x, w, cos, sin, rstd});
    ctx->saved_data["eps"] = eps;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const auto &x = s[0], &w = s[1], &cos = s[2], &sin = s[3], &rstd = s[4];
    const double eps = ctx->saved_data["eps"].toDouble();
    auto dy = grads[0].contiguous();
    if (rstd.defined()) {
      const int64_t vectors = x.size(0) * x.size(1);
      const int64_t blocks = std::min<int64_t>(kNormRopeBlocks, (vectors + 7) / 8);
      auto dx = at::empty_like(x, at::MemoryFormat::Contiguous);
      auto part = at::empty({blocks, x.size(2)}, x.options().dtype(at::kFloat));
      DflashFusedLayerCall c{};
      c.op = 5;
      c.heads = static_cast<int32_t>(x.size(1)), c.dim = static_cast<int32_t>(x.size(2));
      c.rows = x.size(0), c.table_rows = cos.size(0), c.eps = eps, c.blocks = blocks;
      c.a = ptr(dy), c.b = ptr(cos), c.c = ptr(sin), c.d = ptr(w), c.e = ptr(x), c.f = ptr(rstd);
      c.out0 = ptr(dx), c.out1 = ptr(part);
      if (launch(c, x)) return {dx, part.sum(0).to(w.scalar_type()), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    // The ops' own gradients, through the forward recomputed.
    at::AutoGradMode grad_mode(true);
    auto xr = x.detach().requires_grad_(true), wr = w.detach().requires_grad_(true);
    auto g = torch::autograd::grad({norm_rope_ops(xr, wr, cos, sin, eps)}, {xr, wr}, {dy});
    return {g[0], g[1], at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

template <typename F>
void* guarded(F f, char* err, int err_len) {
  try {
    return new at::Tensor(f());
  } catch (const std::exception& e) {
    std::snprintf(err, err_len, "%s", e.what());
    return nullptr;
  }
}

}  // namespace

// Registers the GPU launcher (once per process; a second call replaces it).
extern "C" void dflash_fused_layers_set_launcher(DflashFusedLayerLauncher f) { launcher.store(f); }

// RoPE of x [rows, heads, d] (contiguous) with cos/sin [T, d] (contiguous, of x's kind, rows a
// multiple of T), recorded for autograd in x. Returns a new at::Tensor* (owned by the caller), or
// null with `err` filled.
extern "C" void* dflash_fused_rope(void* x, void* cos, void* sin, char* err, int err_len) {
  return guarded(
      [&] {
        const auto& xt = *static_cast<at::Tensor*>(x);
        const auto& ct = *static_cast<at::Tensor*>(cos);
        const auto& st = *static_cast<at::Tensor*>(sin);
        TORCH_CHECK(xt.dim() == 3 && ct.dim() == 2 && ct.sizes() == st.sizes() && ct.size(1) == xt.size(2) &&
                        xt.size(2) % 2 == 0 && ct.size(0) > 0 && xt.size(0) % ct.size(0) == 0,
                    "fused RoPE: x ", xt.sizes(), " and tables ", ct.sizes(), " do not fit");
        TORCH_CHECK(xt.is_contiguous() && ct.is_contiguous() && st.is_contiguous(), "fused RoPE: non-contiguous input");
        TORCH_CHECK(ct.scalar_type() == xt.scalar_type() && st.scalar_type() == xt.scalar_type() &&
                        ct.device() == xt.device() && st.device() == xt.device(),
                    "fused RoPE: the tables' kind or device differs from x's");
        return Rope::apply(xt, ct, st);
      },
      err, err_len);
}

// silu(gate) * up of two contiguous tensors of one shape and kind, recorded for autograd.
// Returns a new at::Tensor* (owned by the caller), or null with `err` filled.
extern "C" void* dflash_fused_swiglu(void* gate, void* up, char* err, int err_len) {
  return guarded(
      [&] {
        const auto& g = *static_cast<at::Tensor*>(gate);
        const auto& u = *static_cast<at::Tensor*>(up);
        TORCH_CHECK(g.sizes() == u.sizes() && g.scalar_type() == u.scalar_type(), "fused SwiGLU: gate ", g.sizes(),
                    " and up ", u.sizes(), " differ");
        TORCH_CHECK(g.is_contiguous() && u.is_contiguous(), "fused SwiGLU: non-contiguous input");
        return Swiglu::apply(g, u);
      },
      err, err_len);
}

// The per-head RMS norm of x [rows, heads, d] with weight w [d] (epsilon `eps`), then RoPE with
// cos/sin [T, d] as `dflash_fused_rope` takes them; all contiguous, of one kind and device,
// recorded for autograd in x and w. Returns a new at::Tensor* (owned by the caller), or null
// with `err` filled.
extern "C" void* dflash_fused_norm_rope(void* x, void* w, void* cos, void* sin, double eps, char* err,
                                        int err_len) {
  return guarded(
      [&] {
        const auto& xt = *static_cast<at::Tensor*>(x);
        const auto& wt = *static_cast<at::Tensor*>(w);
        const auto& ct = *static_cast<at::Tensor*>(cos);
        const auto& st = *static_cast<at::Tensor*>(sin);
        TORCH_CHECK(xt.dim() == 3 && wt.dim() == 1 && wt.size(0) == xt.size(2) && ct.dim() == 2 &&
                        ct.sizes() == st.sizes() && ct.size(1) == xt.size(2) && xt.size(2) % 2 == 0 &&
                        ct.size(0) > 0 && xt.size(0) % ct.size(0) == 0,
                    "fused norm + RoPE: x ", xt.sizes(), ", weight ", wt.sizes(), " and tables ", ct.sizes(),
                    " do not fit");
        TORCH_CHECK(xt.is_contiguous() && wt.is_contiguous() && ct.is_contiguous() && st.is_contiguous(),
                    "fused norm + RoPE: non-contiguous input");
        for (const auto* t : {&wt, &ct, &st}) {
          TORCH_CHECK(t->scalar_type() == xt.scalar_type() && t->device() == xt.device(),
                      "fused norm + RoPE: the weight's or tables' kind or device differs from x's");
        }
        return NormRope::apply(xt, wt, ct, st, eps);
      },
      err, err_len);
}
