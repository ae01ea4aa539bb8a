// Switches libtorch's choice of attention backend that tch does not expose.
// The cuDNN attention backend builds an execution plan for every new input
// shape; packed variable-length sequences present new shapes all the time,
// which made the target forward twice as slow (see BENCHMARKS.md). With it
// off, scaled_dot_product_attention uses the flash / memory-efficient kernels.
#include <ATen/Context.h>

extern "C" void dflash_set_cudnn_sdp(int enabled) { at::globalContext().setSDPUseCuDNN(enabled != 0); }

extern "C" int dflash_cudnn_sdp_enabled() { return at::globalContext().userEnabledCuDNNSDP() ? 1 : 0; }

// Deterministic algorithms only (torch.use_deterministic_algorithms); with
// warn_only, an op that has no deterministic kernel warns (naming itself) and
// runs its nondeterministic one.
extern "C" void dflash_set_deterministic(int on, int warn_only) {
  at::globalContext().setDeterministicAlgorithms(on != 0, warn_only != 0);
}
