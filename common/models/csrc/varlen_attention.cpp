// Causal attention over packed variable-length sequences in one flash call,
// with an optional sliding window, returning the output and its
// log-sum-exp (which gpt-oss's attention sinks rescale by). tch exposes
// neither libtorch's variable-length flash forward nor its window.
#include <ATen/ATen.h>

#include <cstdio>
#include <optional>

namespace {

at::Tensor& t(void* p) { return *static_cast<at::Tensor*>(p); }

// The log-sum-exp as [heads, total]: flash returns that for variable-length
// calls in recent versions and [seqs, heads, max_len] in older ones.
at::Tensor lse_rows(const at::Tensor& lse, const at::Tensor& cu) {
  if (lse.dim() == 2) return lse;
  TORCH_CHECK(lse.dim() == 3, "varlen attention: unexpected log-sum-exp shape ", lse.sizes());
  auto bounds = cu.to(at::kCPU, at::kLong);
  auto b = bounds.accessor<int64_t, 1>();
  std::vector<at::Tensor> parts;
  for (int64_t s = 0; s + 1 < bounds.size(0); ++s) parts.push_back(lse[s].narrow(1, 0, b[s + 1] - b[s]));
  return at::cat(parts, 1);
}

}  // namespace

// q [T, heads, d], k and v [T, kv_heads, d] (bf16/f16, CUDA), cu [seqs + 1]
// int32 cumulative lengths. window_left < 0: no window; else a query sees
// itself and the window_left positions before it.
extern "C" int dflash_varlen_attention(void* q, void* k, void* v, void* cu, int64_t max_len, double scale,
                                       int64_t window_left, void** out, void** lse, char* err, int err_len) {
  try {
    std::optional<int64_t> left, right;
    if (window_left >= 0) {
      left = window_left;
      right = 0;
    }
    auto r = at::_flash_attention_forward(t(q), t(k), t(v), t(cu), t(cu), max_len, max_len, 0.0, /*is_causal=*/true,
                                          /*return_debug_mask=*/false, scale, left, right);
    *out = new at::Tensor(std::get<0>(r));
    *lse = new at::Tensor(lse_rows(std::get<1>(r), t(cu)));
    return 0;
  } catch (const std::exception& e) {
    snprintf(err, err_len, "%s", e.what());
    return 1;
  }
}
