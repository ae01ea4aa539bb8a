#!/usr/bin/env bash
# One call on an H200 machine: the capture benchmark (off / async / sync)
# twice, printing each pipelined mode's forward GPU time from timing events
# next to its step time: equal means postprocessing leaves gaps between
# forwards; larger means it slows the forward's kernels. Binary in .device/cap.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
for round in 1 2; do
  echo "== round $round"
  timeout 200 .device/cap/dflash-target bench-capture --shape qwen3-8b --device 0 --layers 5 \
    --batches 20 --warmup 3 --json "$OUT/capture-$round.json" 2>&1 | grep -v INFO | tail -4
done
