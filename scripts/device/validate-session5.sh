#!/usr/bin/env bash
# One call on a 2-GPU H200 machine validating the split block attention in
# the services: the ignored GPU tests (services on one GPU; two data-parallel
# replicas staying identical), the split attention's CUDA test, and the
# drafter step alone against end to end (PADS=128). Binaries in .device/bin.
set -u
cd "$(dirname "$0")/../.."
bash scripts/device/gpu-tests.sh
. scripts/device/env.sh
echo "== split attention on CUDA against the masked attention"
timeout 120 .device/bin/models-tests --ignored --exact \
  split_attention::tests::split_attention_on_cuda_matches_the_masked_attention 2>&1 | grep "test result"
PADS=128 bash scripts/device/bench-e2e.sh
grep -h "block attention" "$OUT"/e2e-128.log | head -2
