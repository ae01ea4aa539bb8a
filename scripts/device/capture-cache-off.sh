#!/usr/bin/env bash
# One call on an H200: the capture benchmark with the forward loop before the
# target feature cache (.device/old/dflash-target, e37f2e3) and after it, the
# cache off as by default (.device/bin/dflash-target), two rounds alternating.
# Results in $OUT.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
for round in 1 2; do
  for build in old bin; do
    echo "== capture, $build (r$round)"
    timeout 150 .device/$build/dflash-target bench-capture --shape qwen3-8b --device 0 --layers 5 \
      --batches 20 --warmup 3 --json "$OUT/capture-$build-r$round.json" 2>&1 | grep -v INFO | tail -5
  done
done
