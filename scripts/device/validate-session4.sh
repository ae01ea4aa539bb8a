#!/usr/bin/env bash
# One call on a 2-GPU H200 machine validating session 4's build: the ignored
# GPU tests (services on one GPU; two data-parallel replicas staying
# identical, now with the fused AdamW), the fused kernel's own CUDA test,
# the drafter step alone and end to end (PADS=128), the capture benchmark
# (off / async / sync) and the pinned transport. Binaries in .device/bin.
set -u
cd "$(dirname "$0")/../.."
bash scripts/device/gpu-tests.sh
. scripts/device/env.sh
echo "== fused AdamW on CUDA against the CPU kernel"
timeout 120 .device/bin/models-tests --ignored --exact optim::tests::fused_adamw_on_cuda_matches_the_cpu_update 2>&1 | grep "test result"
PADS=128 bash scripts/device/bench-e2e.sh
. scripts/device/before-after.sh
capture bin s4
transport bin s4
