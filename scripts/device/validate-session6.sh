#!/usr/bin/env bash
# One call on an H200 for session 6's changes: the CUDA tests (the bf16
# cross-entropy with probabilities written in bf16, the split attention, the
# fused AdamW; the services on one GPU), the drafter step before (.device/old)
# and after (.device/bin) the bf16 probabilities, alternated, and the target's
# capture with the forward loop's idle time split into "next forward not
# queued yet" and "waiting for its ids upload" (the new build only reports it).
# `validate-session6.sh tests` runs the tests, without an argument the
# benchmarks (two calls: each fits the 10-minute limit). Results in $OUT.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
. scripts/device/before-after.sh
if [ "${1:-bench}" = tests ]; then
  echo "== CUDA tests"
  timeout 200 .device/bin/models-tests --ignored 2>&1 | grep -E "^test |test result"
  timeout 240 .device/bin/deps/gpu --ignored --exact services_train_on_one_gpu 2>&1 | grep -E "^test |test result"
  exit
fi
for round in 1 2 3; do
  capture bin r$round
done
split_step() { # <build> <tag> [batches] [warmup]
  echo "== .device/$1: drafter step, split attention, 512 anchors, ${3:-12} batches, warmup ${4:-2}"
  timeout 200 ".device/$1/dflash-drafter" bench-step --shape qwen3-8b --device 0 --attention split --anchors 512 \
    --chunks 16 --context-multiple 128 --batch-tokens 12288 --batches "${3:-12}" --max-blocks 2048 --steps 12 \
    --warmup "${4:-2}" --json "$OUT/step-$1-$2.json" 2>&1 | grep -v INFO | tail -2
}
for round in 1 2; do
  split_step old r$round
  split_step bin r$round
done
split_step old warm 4 8
split_step bin warm 4 8
nvidia-smi --query-gpu=name,memory.used --format=csv
