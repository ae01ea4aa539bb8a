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
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cstdio>

namespace {

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

at::Tensor convolve(const Shape& s, const at::Tensor& x, const at::Tensor& dyn, const at::Tensor& base) {
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
