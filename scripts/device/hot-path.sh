#!/usr/bin/env bash
# The hot path on one H200, for regression checks: target capture of the
# Qwen3-8B shape (postprocess off / async / sync), the drafter's training
# step at 512 and 256 anchors over 12 distinct batches, and the hidden-state
# stream into pinned buffers against raw TCP. Each build named on the command
# line (folders under .device holding stripped release binaries) is measured
# in alternating rounds, so that builds compare within one machine and one
# call. Results (JSON per benchmark) go to $OUT.
#   scripts/device/hot-path.sh [ROUNDS] [BUILD...]   (default: 2 rounds of .device/bin)
# ANCHORS (default "512 256") and CAPTURE_BATCHES (default 20) trim a run to
# the device time at hand.
# A build from before the tools moved to `dflash` (dflash-target bench-capture,
# dflash-drafter bench-step / bench-transport) is run the way it was called.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
rounds=${1:-2}
shift || true
builds=${*:-bin}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc

# tool <build> <old binary>: how a build calls a benchmark.
tool() {
  if [ -x ".device/$1/dflash" ]; then echo ".device/$1/dflash"; else echo ".device/$1/$2"; fi
}

for round in $(seq "$rounds"); do
  for b in $builds; do
    echo "== round $round, .device/$b: capture"
    timeout 150 $(tool "$b" dflash-target) bench-capture --shape qwen3-8b --device 0 --layers 5 \
      --batches "${CAPTURE_BATCHES:-20}" --warmup 3 --json "$OUT/capture-$b-$round.json" 2>&1 | grep -v INFO | tail -4
    for anchors in ${ANCHORS:-512 256}; do
      echo "== round $round, .device/$b: drafter step, $anchors anchors"
      timeout 200 $(tool "$b" dflash-drafter) bench-step --shape qwen3-8b --device 0 --anchors "$anchors" --attention split --chunks 64 \
        --context-multiple 128 --batch-tokens 12288 --batches 12 --max-blocks 2048 --steps 12 --warmup 2 \
        --json "$OUT/step-$anchors-$b-$round.json" 2>&1 | grep -v INFO | tail -2
    done
    echo "== round $round, .device/$b: transport, pinned landing"
    timeout 120 $(tool "$b" dflash-drafter) bench-transport --device 0 --streams 1,2,4 \
      --json "$OUT/transport-$b-$round.json" 2>&1 | grep -v INFO | tail -4
  done
done
