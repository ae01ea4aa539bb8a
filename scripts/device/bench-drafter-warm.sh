#!/usr/bin/env bash
# One call on an H200 machine: the drafter step over 4 distinct batches,
# with a warm-up that visits each twice, so that every attention shape has
# its cuDNN plan before timing starts (the steady state of a long run);
# before (.device/old) and after (.device/bin) a change. Results in $OUT.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
step() {  # step <build> <anchors> <chunks> <tag>
  echo "== .device/$1: drafter step, $2 anchors, chunks $3, warm"
  timeout 240 .device/$1/dflash-drafter bench-step --shape qwen3-8b --device 0 --anchors $2 --chunks $3 \
    --context-multiple 128 --batch-tokens 12288 --batches 4 --max-blocks 2048 --steps 12 --warmup 8 \
    --json "$OUT/warm-$4.json" 2>&1 | grep -v INFO | tail -4
}
step old 512 64 old-512
step bin 512 64,32,16 new-512
step bin 256 64,16 new-256
step old 256 64 old-256
