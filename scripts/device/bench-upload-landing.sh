#!/usr/bin/env bash
# One call on an H200 machine: before/after a change to the two CPU-side
# hot paths, with stripped release builds in .device/old (before) and
# .device/bin (after):
#  - target capture with postprocess off / async / sync (the ids upload);
#  - the hidden-state stream against raw TCP, landing in the GPU drafter's
#    pooled pinned buffers (the landing thread).
# Two rounds each, alternating builds, so drift shows. Results go to $OUT.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
nproc
for round in 1 2; do
  for build in old bin; do
    echo "== round $round, .device/$build: capture"
    timeout 150 .device/$build/dflash-target bench-capture --shape qwen3-8b --device 0 --layers 5 \
      --batches 20 --warmup 3 --json "$OUT/capture-$build-$round.json" 2>&1 | grep -v INFO | tail -4
  done
done
for round in 1 2; do
  for build in old bin; do
    echo "== round $round, .device/$build: transport, pinned landing"
    timeout 120 .device/$build/dflash-drafter bench-transport --device 0 --streams 1,2,4 \
      --json "$OUT/transport-$build-$round.json" 2>&1 | grep -v INFO | tail -4
  done
done
