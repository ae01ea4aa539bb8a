#!/usr/bin/env bash
# One call on an H200 machine: the drafter step (Qwen3-8B-shaped 5-layer
# drafter) over 12 distinct batches, before (.device/old) and after
# (.device/bin) a change to the block attention, for several chunk sizes;
# then more rounds of the capture benchmark (off / async / sync) for both
# builds. Stripped release builds; results go to $OUT.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc
step() {  # step <build> <anchors> <chunks> <tag>
  echo "== .device/$1: drafter step, $2 anchors, chunks $3"
  timeout 240 .device/$1/dflash-drafter bench-step --shape qwen3-8b --device 0 --anchors $2 --chunks $3 \
    --context-multiple 128 --batch-tokens 12288 --batches 12 --max-blocks 2048 --steps 12 --warmup 2 \
    --json "$OUT/step-$4.json" 2>&1 | grep -v INFO | tail -4
}
step old 512 64 old-512
step bin 512 64,32,16 new-512
step bin 256 64,32,16 new-256
step old 256 64 old-256
for round in 3 4; do
  for build in old bin; do
    echo "== round $round, .device/$build: capture"
    timeout 150 .device/$build/dflash-target bench-capture --shape qwen3-8b --device 0 --layers 5 \
      --batches 20 --warmup 3 --json "$OUT/capture-$build-$round.json" 2>&1 | grep -v INFO | tail -4
  done
done
