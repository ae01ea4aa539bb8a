#!/usr/bin/env bash
# One call on an H200 machine for the hand-written cross-entropy gradient
# and the fused AdamW: the fused kernel's CUDA test, then the drafter step at
# 512 anchors before (.device/old) and after (.device/bin), over 12 distinct
# batches and over 4 warm ones, alternating builds. Results in $OUT.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
. scripts/device/before-after.sh
echo "== fused AdamW on CUDA against the CPU kernel"
timeout 120 .device/bin/models-tests --ignored --exact optim::tests::fused_adamw_on_cuda_matches_the_cpu_update 2>&1 | tail -3
for round in 1 2; do
  for build in old bin; do
    drafter_step $build 512 64 $build-$round
  done
done
for build in old bin; do
  drafter_step $build 512 64 warm-$build 4 8
done
