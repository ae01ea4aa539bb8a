// The drafter layer's rotary embedding and SwiGLU as autograd functions
// whose two directions are each one GPU kernel (csrc/fused_layers.cu), in
// place of libtorch's chains: RoPE as `x * cos + cat(-x2, x1) * sin` made
// five passes forward (a negation, a concatenation, two products, a sum)
// and as many back; SwiGLU as `silu(gate) * up` two forward and three back,
// with autograd keeping silu(gate) as well as gate and up. Here each
// direction reads its inputs once and writes its outputs once, in f32,
// rounding once; SwiGLU keeps only gate and up.
//
// The kernels are launched by the Rust side (src/fused_layers.rs registers
// the launcher): this library is built against libtorch's CPU half and
// cannot launch CUDA itself. Where the launcher declines (a shape or kind
// the kernels do not take), the same math runs as libtorch ops inside the
// same autograd function, which is also what the CPU tests check.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>
#include <cstdio>

// One call of the GPU launcher (src/fused_layers.rs reads it field by field).
struct DflashFusedLayerCall {
  int32_t op;      // 0: RoPE forward; 1: RoPE backward; 2: SwiGLU forward; 3: SwiGLU backward
  int32_t device;  // the CUDA ordinal
  int32_t bf16;    // 1: bf16 tensors; 0: f32
  int32_t heads;   // RoPE: heads per row
  int32_t dim;     // RoPE: head size
  int64_t rows;    // RoPE: rows of [rows, heads, dim]
  int64_t table_rows;  // RoPE: rows of the [table_rows, dim] tables; row r reads r % table_rows
  int64_t numel;   // SwiGLU: elements of each tensor
  // RoPE: a = x (or the output's gradient), b = cos, c = sin, out0 = the result.
  // SwiGLU forward: a = gate, b = up, out0 = silu(gate) * up.
  // SwiGLU backward: a = the output's gradient, b = gate, c = up, out0 = gate's gradient, out1 = up's.
  uint64_t a, b, c, out0, out1;
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
