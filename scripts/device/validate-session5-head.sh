#!/usr/bin/env bash
# One call on an H200 validating the session's last build: the split
# attention's CUDA test, the services on one GPU (ignored test), and the
# drafter step with the split attention at 512 anchors (12 distinct batches).
# Binaries in .device/bin (the test binaries in .device/bin and .device/bin/deps).
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
timeout 120 .device/bin/models-tests --ignored --exact \
  split_attention::tests::split_attention_on_cuda_matches_the_masked_attention 2>&1 | grep "test result"
timeout 200 .device/bin/deps/gpu --ignored --exact services_train_on_one_gpu 2>&1 | grep -E "^test |test result"
timeout 200 .device/bin/dflash-drafter bench-step --shape qwen3-8b --device 0 --attention split --anchors 512 \
  --chunks 16 --context-multiple 128 --batch-tokens 12288 --batches 12 --max-blocks 2048 --steps 12 --warmup 2 \
  --json "$OUT/step-head.json" 2>&1 | grep -v INFO | tail -2
