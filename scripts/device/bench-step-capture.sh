#!/usr/bin/env bash
# One call on an H200 machine: before (.device/old) and after (.device/bin)
# a change to the training step or the target forward: the drafter step at
# 512 anchors over 12 distinct batches and over 4 warm ones, and the capture
# benchmark (off / async / sync). Stripped release builds; results in $OUT.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
for build in old bin; do
  echo "== .device/$build: drafter step, 512 anchors, 12 distinct batches"
  timeout 200 .device/$build/dflash-drafter bench-step --shape qwen3-8b --device 0 --anchors 512 --chunks 64 \
    --batch-tokens 12288 --batches 12 --max-blocks 2048 --steps 12 --warmup 2 \
    --json "$OUT/step-$build.json" 2>&1 | grep -v INFO | tail -1
  echo "== .device/$build: drafter step, 512 anchors, 4 warm batches"
  timeout 200 .device/$build/dflash-drafter bench-step --shape qwen3-8b --device 0 --anchors 512 --chunks 64 \
    --batch-tokens 12288 --batches 4 --max-blocks 2048 --steps 12 --warmup 8 \
    --json "$OUT/warm-$build.json" 2>&1 | grep -v INFO | tail -1
done
for build in old bin; do
  echo "== .device/$build: capture"
  timeout 150 .device/$build/dflash-target bench-capture --shape qwen3-8b --device 0 --layers 5 \
    --batches 20 --warmup 3 --json "$OUT/capture-$build.json" 2>&1 | grep -v INFO | tail -4
done
