// y = x w^T with FP8 matmuls in the forward and the backward (issue 40's
// training.precision = "fp8"): x and w in e4m3 for the forward, the output
// gradient in e5m2 for the two backward matmuls (e5m2 x e4m3), every product
// accumulated by cuBLASLt (`at::_scaled_mm`) and written in the input's
// half-precision kind. Scaling is per tensor and current (Transformer
// Engine's "current scaling"): each operand is divided by amax / fp8_max just
// before it is cast, so the largest magnitude lands on the format's largest
// finite value; nothing is carried between steps. The master weights, the
// optimizer and every other op of the step stay as they are.
//
// _scaled_mm wants its first operand row-major and its second column-major,
// both dimensions multiples of 16: rows (tokens) are padded with zeros to a
// multiple of 16 (they add nothing to the weight gradient and are cut from
// the outputs); K and N must already be multiples of 16 (the Rust side
// checks and falls back to the bf16 matmul otherwise). Each operand is
// cast straight into the layout its matmul reads (a transposed read where
// needed), and the forward saves x^T in e4m3 (half the bytes of bf16 x) for
// the weight gradient. tch has no custom autograd
// functions, hence this file.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <cstdio>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr double E4M3_MAX = 448.0;
constexpr double E5M2_MAX = 57344.0;

// The per-tensor scale that maps t's largest magnitude onto `max`: one
// reduction (aminmax, in t's own kind, no temporary copy) and a few scalar
// kernels; f32, 0-dim, on t's device. An all-zero tensor gets scale 1.
at::Tensor absmax_scale(const at::Tensor& t, double max) {
  auto [lo, hi] = at::aminmax(t);
  auto amax = at::maximum(lo.abs(), hi.abs()).to(at::kFloat);
  return at::where(amax > 0, amax / max, at::ones_like(amax));
}

// t / scale in `kind`, row-major, or its transpose row-major: the cast
// reads t where it lies (a transposed read), so that no fp8 transpose of
// its own is needed.
at::Tensor cast(const at::Tensor& t, const at::Tensor& scale, at::ScalarType kind, bool transposed) {
  const auto src = transposed ? t.t() : t;
  auto q = at::empty(src.sizes(), t.options().dtype(kind));
  at::mul_out(q, src, scale.reciprocal());
  return q;
}

int64_t padded(int64_t rows) { return (rows + 15) / 16 * 16; }

// `t` [rows, cols] with zero rows appended up to `to` rows.
at::Tensor pad_rows(const at::Tensor& t, int64_t to) {
  if (t.size(0) == to) return t;
  return at::constant_pad_nd(t, {0, 0, 0, to - t.size(0)}, 0);
}

struct Fp8Linear : public torch::autograd::Function<Fp8Linear> {
  // x [M, K], w [N, K], both bf16 (or f16), K and N multiples of 16.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w) {
    const int64_t m = x.size(0);
    const auto out_kind = x.scalar_type();
    const auto xp = pad_rows(x.contiguous(), padded(m));
    const auto sx = absmax_scale(xp, E4M3_MAX);
    const auto sw = absmax_scale(w, E4M3_MAX);
    // w8.t() is [K, N] column-major: the second operand as _scaled_mm wants it.
    auto y = at::_scaled_mm(cast(xp, sx, at::kFloat8_e4m3fn, false), cast(w, sw, at::kFloat8_e4m3fn, false).t(), sx,
                            sw, std::nullopt, std::nullopt, out_kind, /*use_fast_accum=*/false);
    // The backward's weight gradient reads x by columns: x^T in e4m3 (as
    // many bytes as x8, half of x).
    ctx->save_for_backward({cast(xp, sx, at::kFloat8_e4m3fn, true), sx, w, sw});
    ctx->saved_data["rows"] = m;
    return y.narrow(0, 0, m);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const auto &xt8 = s[0], &sx = s[1], &w = s[2], &sw = s[3];
    const int64_t m = ctx->saved_data["rows"].toInt();
    const auto kind = grads[0].scalar_type();
    const auto gp = pad_rows(grads[0].contiguous(), xt8.size(1));
    const auto sg = absmax_scale(gp, E5M2_MAX);
    at::Tensor dx, dw;
    if (ctx->needs_input_grad(0)) {
      // dx = g w: [M, N] x [N, K], w as [N, K] column-major (= (w^T)^T).
      auto wt8 = cast(w, sw, at::kFloat8_e4m3fn, true);
      dx = at::_scaled_mm(cast(gp, sg, at::kFloat8_e5m2, false), wt8.t(), sg, sw, std::nullopt, std::nullopt, kind,
                          false)
               .narrow(0, 0, m);
    }
    if (ctx->needs_input_grad(1)) {
      // dw = g^T x: [N, M] row-major x [M, K] column-major (= (x^T)^T).
      dw = at::_scaled_mm(cast(gp, sg, at::kFloat8_e5m2, true), xt8.t(), sg, sx, std::nullopt, std::nullopt, kind,
                          false);
    }
    return {dx, dw};
  }
};

}  // namespace

// y = x w^T through FP8 matmuls (x [M, K], w [N, K]) while autograd records. Returns a new
// at::Tensor* (owned by the caller), or null with `err` filled.
extern "C" void* dflash_fp8_linear(void* x, void* w, char* err, int err_len) {
  try {
    const auto& xt = *static_cast<at::Tensor*>(x);
    const auto& wt = *static_cast<at::Tensor*>(w);
    // Without autograd (evaluation, generation) the drafter computes as it
    // is served: the matmul in its own kind.
    if (!at::GradMode::is_enabled()) return new at::Tensor(at::linear(xt, wt));
    auto out = Fp8Linear::apply(xt, wt);
    return new at::Tensor(std::move(out));
  } catch (const std::exception& e) {
    std::snprintf(err, err_len, "%s", e.what());
    return nullptr;
  }
}
