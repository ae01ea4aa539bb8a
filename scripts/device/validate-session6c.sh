#!/usr/bin/env bash
# Last call of session 6 on an H200: the target's GPU idle accounting test,
# the services on one GPU, and the capture benchmark once more with the
# final build. Binaries in .device/bin (test binaries: target-tests,
# deps/gpu). Results in $OUT.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
timeout 120 .device/bin/target-tests --ignored 2>&1 | grep -E "^test |test result|panicked|assert"
timeout 240 .device/bin/deps/gpu --ignored --exact services_train_on_one_gpu 2>&1 | grep -E "^test |test result"
timeout 150 .device/bin/dflash-target bench-capture --shape qwen3-8b --device 0 --layers 5 \
  --batches 20 --warmup 3 --json "$OUT/capture-final.json" 2>&1 | grep -v INFO | tail -6
