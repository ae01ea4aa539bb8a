// DFlash2's in-block dynamic convolution (common/models/src/dflash2.rs,
// `BlockConv`) as one autograd function (issue 40: DFlash2 at DFlash's cost).
//
//   out[j][c] = sum_t (base[t][c] + dyn[j][t][c / gs]) * x[j - t][c]
//
// within each block of `block_len` slots (x[j - t] is zero before the
// block's first slot). Written as libtorch ops under autograd, each tap
// built a full-size kernel (base + dyn, broadcast over the group) and a
// padded, shifted copy of x, and autograd kept both for the backward: 2K
// full-size tensors per convolution, two convolutions per sublayer, where
// DFlash keeps none. Here the forward adds each tap into the output in
// place through broadcasting (no full-size temporaries) and saves only x,
// dyn (K / gs of x's size) and base; the backward recomputes each tap's
// product g[j] * x[j - t] once, and reduces it to both the base's and the
// dynamic coefficients' gradients. tch has no custom autograd functions,
// hence this file.
//
// On a GPU each direction is one kernel (csrc/block_conv.cu) where the Rust
// side has registered its launcher (src/block_conv_cuda.rs): this library
// is built against libtorch's CPU half and cannot launch CUDA itself. The
// launcher declines shapes its kernels do not take, and the loops below run.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <tuple>

// One call of the GPU launcher (src/block_conv_cuda.rs reads it field by field).
struct DflashBlockConvCall {
  int32_t backward;  // 0: the forward; 1: the backward
  int32_t device;    // the CUDA ordinal
  int32_t bf16;      // 1: bf16 tensors; 0: f32
  int32_t bl, k, groups, gs, chunk_rows;
  int64_t rows, h, dyn_stride;
  // The forward reads x, dyn, base and writes out; the backward reads g, x,
  // dyn, base and writes out (x's gradient), gdyn and gbase (f32 partials).
  const void *x, *dyn, *base, *g;
  void *out, *gdyn, *gbase;
};

// 0: done; 1: declined (the loops run); else an error written into err.
typedef int32_t (*DflashBlockConvLauncher)(const DflashBlockConvCall* call, char* err, int32_t err_len);

namespace {

std::atomic<DflashBlockConvLauncher> launcher{nullptr};

// Rows of whole blocks per thread of the GPU kernels: enough that the base
// kernel's gradient is reduced on chip over many rows, few enough that the
// grid fills the GPU.
int64_t chunk_rows(int64_t bl) { return bl * std::max<int64_t>(1, 64 / bl); }

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The sizes of one call: x [n, q, h] seen as [n, blocks, bl, groups, gs],
// dyn [n, q, k, groups], base [k, h].
struct Shape {
  int64_t n, q, h, blocks, bl, groups, gs, k, taps;

  Shape(const at::Tensor& x, const at::Tensor& dyn, const at::Tensor& base, int64_t block_len, int64_t group_size) {
    TORCH_CHECK(x.dim() == 3, "block conv: x must be [n, q, h], got ", x.sizes());
    n = x.size(0), q = x.size(1), h = x.size(2), bl = block_len, gs = group_size;
    TORCH_CHECK(bl > 0 && q % bl == 0, "block conv: ", q, " slots are not whole blocks of ", bl);
    TORCH_CHECK(gs > 0 && h % gs == 0, "block conv: hidden ", h, " is not whole groups of ", gs);
    blocks = q / bl, groups = h / gs, k = base.size(0);
    TORCH_CHECK(dyn.sizes() == at::IntArrayRef({n, q, k, groups}), "block conv: dynamic coefficients ", dyn.sizes(),
                ", want [", n, ", ", q, ", ", k, ", ", groups, "]");
    TORCH_CHECK(base.dim() == 2 && base.size(1) == h, "block conv: base kernel ", base.sizes(), ", want [", k, ", ",
                h, "]");
    // Taps past the block's length read only the zeros before it.
    taps = std::min(k, bl);
  }

  at::Tensor values(const at::Tensor& x) const { return x.reshape({n, blocks, bl, groups, gs}); }

  // Tap t's dynamic coefficients [n, blocks, bl, groups, 1].
  at::Tensor dynamic(const at::Tensor& dyn, int64_t t) const {
    return dyn.reshape({n, blocks, bl, k, groups, 1}).select(3, t);
  }

  // Tap t's base kernel [1, 1, 1, groups, gs].
  at::Tensor base_tap(const at::Tensor& base, int64_t t) const {
    return base.select(0, t).reshape({1, 1, 1, groups, gs});
  }
};

// The call's common fields for x [n, q, h] (contiguous) and dyn [n, q, k,
// groups] and base [k, h] of its kind; None where no GPU kernel can take them.
std::optional<DflashBlockConvCall> gpu_call(const Shape& s, const at::Tensor& x, const at::Tensor& dyn,
                                            const at::Tensor& base) {
  if (!x.is_cuda() || launcher.load() == nullptr) return std::nullopt;
  const auto kind = x.scalar_type();
  if ((kind != at::kBFloat16 && kind != at::kFloat) || dyn.scalar_type() != kind || base.scalar_type() != kind) {
    return std::nullopt;
  }
  if (s.bl > INT32_MAX || s.k > INT32_MAX || s.groups > INT32_MAX || s.gs > INT32_MAX) return std::nullopt;
  DflashBlockConvCall c{};
  c.device = x.get_device();
  c.bf16 = kind == at::kBFloat16;
  c.bl = s.bl, c.k = s.k, c.groups = s.groups, c.gs = s.gs, c.chunk_rows = chunk_rows(s.bl);
  c.rows = s.n * s.q, c.h = s.h;
  return c;
}

// dyn with each row's [k, groups] dense: as given where it is (the side
// views `prepare` makes are), else a copy.
at::Tensor dense_rows(const Shape& s, const at::Tensor& dyn) {
  const bool dense = dyn.stride(3) == 1 && dyn.stride(2) == s.groups && dyn.stride(0) == s.q * dyn.stride(1);
  return dense ? dyn : dyn.contiguous();
}

// Runs a call; false where the launcher declined it.
bool launch(const DflashBlockConvCall& call) {
  char err[512] = {0};
  const int32_t rc = launcher.load()(&call, err, sizeof(err));
  TORCH_CHECK(rc == 0 || rc == 1, "block conv on cuda:", call.device, ": ", err);
  return rc == 0;
}

std::optional<at::Tensor> convolve_gpu(const Shape& s, const at::Tensor& x, const at::Tensor& dyn,
                                       const at::Tensor& base) {
  auto call = gpu_call(s, x, dyn, base);
  if (!call) return std::nullopt;
  const auto xc = x.contiguous(), dc = dense_rows(s, dyn), bc = base.contiguous();
  call->dyn_stride = dc.stride(1);
  auto out = at::empty_like(xc, at::MemoryFormat::Contiguous);
  call->x = xc.data_ptr(), call->dyn = dc.data_ptr(), call->base = bc.data_ptr(), call->out = out.data_ptr();
  if (!launch(*call)) return std::nullopt;
  return out;
}

// x's, dyn's and base's gradients from the output's gradient g.
std::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>> backward_gpu(const Shape& s, const at::Tensor& g,
                                                                           const at::Tensor& x, const at::Tensor& dyn,
                                                                           const at::Tensor& base) {
  // A backward that records a graph (double backward) runs the libtorch
  // passes, which autograd can differentiate.
  if (at::GradMode::is_enabled()) return std::nullopt;
  auto call = gpu_call(s, x, dyn, base);
  if (!call || g.scalar_type() != x.scalar_type()) return std::nullopt;
  const auto xc = x.contiguous(), dc = dense_rows(s, dyn), bc = base.contiguous();
  call->dyn_stride = dc.stride(1);
  call->backward = 1;
  const int64_t chunks = (s.n * s.q + call->chunk_rows - 1) / call->chunk_rows;
  auto gx = at::empty({s.n, s.q, s.h}, x.options());
  auto gd = at::empty({s.n, s.q, s.k, s.groups}, x.options());
  auto partial = at::empty({chunks, s.k, s.h}, x.options().dtype(at::kFloat));
  call->x = xc.data_ptr(), call->dyn = dc.data_ptr(), call->base = bc.data_ptr(), call->g = g.data_ptr();
  call->out = gx.data_ptr(), call->gdyn = gd.data_ptr(), call->gbase = partial.data_ptr();
  if (!launch(*call)) return std::nullopt;
  return std::make_tuple(gx, gd, partial.sum(0).to(base.scalar_type()));
}

at::Tensor convolve(const Shape& s, const at::Tensor& x, const at::Tensor& dyn, const at::Tensor& base) {
  if (auto out = convolve_gpu(s, x, dyn, base)) return out->view({s.n, s.q, s.h});
  const auto v = s.values(x);
  auto out = at::zeros_like(v, at::MemoryFormat::Contiguous);
  for (int64_t t = 0; t < s.taps; ++t) {
    // Slots t.. of each block read slots ..bl-t of the same block.
    const int64_t len = s.bl - t;
    auto o = out.narrow(2, t, len);
    const auto shifted = v.narrow(2, 0, len);
    o.addcmul_(shifted, s.base_tap(base, t));
    o.addcmul_(shifted, s.dynamic(dyn, t).narrow(2, t, len));
  }
  return out.view({s.n, s.q, s.h});
}

struct BlockConv : public torch::autograd::Function<BlockConv> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& dyn, const at::Tensor& base,
                            int64_t block_len, int64_t group_size) {
    const Shape s(x, dyn, base, block_len, group_size);
    ctx->save_for_backward({x, dyn, base});
    ctx->saved_data["block_len"] = block_len;
    ctx->saved_data["group_size"] = group_size;
    return convolve(s, x, dyn, base);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &dyn = saved[1], &base = saved[2];
    const Shape s(x, dyn, base, ctx->saved_data["block_len"].toInt(), ctx->saved_data["group_size"].toInt());
    if (auto gpu = backward_gpu(s, grads[0].contiguous(), x, dyn, base)) {
      auto& [gx, gd, gb] = *gpu;
      return {gx, gd, gb, at::Tensor(), at::Tensor()};
    }
    const auto g = s.values(grads[0].contiguous());
    const auto v = s.values(x);
    at::Tensor gx, gdyn, gbase;
    if (ctx->needs_input_grad(0)) {
      // x[i] fed out[i + t] through tap t.
      gx = at::zeros_like(v, at::MemoryFormat::Contiguous);
      for (int64_t t = 0; t < s.taps; ++t) {
        const int64_t len = s.bl - t;
        auto into = gx.narrow(2, 0, len);
        const auto from = g.narrow(2, t, len);
        into.addcmul_(from, s.base_tap(base, t));
        into.addcmul_(from, s.dynamic(dyn, t).narrow(2, t, len));
      }
      gx = gx.view({s.n, s.q, s.h});
    }
    const bool need_dyn = ctx->needs_input_grad(1), need_base = ctx->needs_input_grad(2);
    if (need_dyn || need_base) {
      auto gd = at::zeros({s.n, s.blocks, s.bl, s.k, s.groups}, dyn.options());
      auto gb = at::zeros({s.k, s.groups, s.gs}, base.options());
      for (int64_t t = 0; t < s.taps; ++t) {
        const int64_t len = s.bl - t;
        // The tap's product, once: summed over the rows it is the base's
        // gradient, over each group's channels the coefficients'.
        const auto p = g.narrow(2, t, len) * v.narrow(2, 0, len);
        if (need_base) gb.select(0, t).copy_(p.sum({0, 1, 2}));
        if (need_dyn) gd.select(3, t).narrow(2, t, len).copy_(p.sum(-1));
      }
      if (need_dyn) gdyn = gd.view({s.n, s.q, s.k, s.groups});
      if (need_base) gbase = gb.view({s.k, s.h});
    }
    return {gx, gdyn, gbase, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

// Registers the GPU launcher (once per process; a second call replaces it).
extern "C" void dflash_block_conv_set_launcher(DflashBlockConvLauncher f) { launcher.store(f); }

// The block convolution of x [n, q, h] with dynamic coefficients [n, q, k, groups] and base kernel
// [k, h] (all of one kind), recorded for autograd when it records. Returns a new at::Tensor*
// (owned by the caller), or null with `err` filled.
extern "C" void* dflash_block_conv(void* x, void* dyn, void* base, int64_t block_len, int64_t group_size, char* err,
                                   int err_len) {
  try {
    const auto& xt = *static_cast<at::Tensor*>(x);
    const auto& dt = *static_cast<at::Tensor*>(dyn);
    const auto& bt = *static_cast<at::Tensor*>(base);
    if (!at::GradMode::is_enabled()) {
      return new at::Tensor(convolve(Shape(xt, dt, bt, block_len, group_size), xt, dt, bt));
    }
    return new at::Tensor(BlockConv::apply(xt, dt, bt, block_len, group_size));
  } catch (const std::exception& e) {
    std::snprintf(err, err_len, "%s", e.what());
    return nullptr;
  }
}
