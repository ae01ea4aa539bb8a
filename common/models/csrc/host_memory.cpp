// Pinned (page-locked) host copies of CPU tensors. tch's pin_memory takes
// a device argument that libtorch has deprecated and warns about on every
// call (a line in the log per upload of a training step); at::Tensor's own
// pin_memory() without it pins for the loaded accelerator, as intended.
#include <ATen/ATen.h>

#include <cstdio>

// Returns a new at::Tensor* (pinned copy of `t`), or null with `err` filled.
extern "C" void* dflash_pin_memory(void* t, char* err, int err_len) {
  try {
    return new at::Tensor(static_cast<at::Tensor*>(t)->pin_memory());
  } catch (const std::exception& e) {
    std::snprintf(err, err_len, "%s", e.what());
    return nullptr;
  }
}
