// PyTorch's fused multi-tensor AdamW kernel (`_fused_adamw_`), which tch
// does not expose (it takes lists of tensors to update in place). One launch
// per group of tensors reads each gradient, moment and fp32 master weight
// once, instead of a kernel per term and tensor.
#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace {
std::vector<at::Tensor> list(at::Tensor** ts, int n) {
  std::vector<at::Tensor> out;
  out.reserve(n);
  for (int i = 0; i < n; ++i) out.push_back(*ts[i]);
  return out;
}
}  // namespace

// Updates `params` (fp32, same device) in place. `step` is a one-element
// fp32 tensor on the device holding the 1-based step count used for bias
// correction; `grad_scale` (nullable) divides every gradient first (global
// norm clipping). Returns 0, or 1 with `err` filled when libtorch threw.
extern "C" int dflash_fused_adamw(at::Tensor** params, at::Tensor** grads, at::Tensor** exp_avgs,
                                  at::Tensor** exp_avg_sqs, int n, at::Tensor* step, double lr,
                                  double beta1, double beta2, double weight_decay, double eps,
                                  at::Tensor* grad_scale, char* err, int err_len) {
  try {
    std::vector<at::Tensor> steps(n, *step);
    std::optional<at::Tensor> scale;
    if (grad_scale != nullptr) scale = *grad_scale;
    at::_fused_adamw_(list(params, n), list(grads, n), list(exp_avgs, n), list(exp_avg_sqs, n), {},
                      steps, lr, beta1, beta2, weight_decay, eps, /*amsgrad=*/false,
                      /*maximize=*/false, scale, std::nullopt);
    return 0;
  } catch (const std::exception& e) {
    snprintf(err, err_len, "%s", e.what());
    return 1;
  }
}
