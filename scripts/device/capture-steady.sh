#!/usr/bin/env bash
# One call on an H200: the capture benchmark (off / async / sync) three
# times, its pipelined modes timed by when each batch arrives (the clock read
# before dropping each payload) and from the GPU timeline. Results in $OUT.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
for round in 1 2 3; do
  echo "== capture (r$round)"
  timeout 150 .device/bin/dflash-target bench-capture --shape qwen3-8b --device 0 --layers 5 \
    --batches 20 --warmup 3 --json "$OUT/capture-r$round.json" 2>&1 | grep -v INFO | tail -6
done
