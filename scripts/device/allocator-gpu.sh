#!/usr/bin/env bash
# The process allocator on one H200: the hidden-state stream into pinned
# buffers (against raw TCP) and the drafter's training step at 512 anchors,
# for each build named (folders under .device with stripped release
# binaries; e.g. one on glibc's malloc with its mmap settings, one on
# jemalloc), in alternating rounds. Results (JSON) go to $OUT.
#   scripts/device/allocator-gpu.sh [ROUNDS] [BUILD...]   (default: 1 round of .device/bin)
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
rounds=${1:-1}
shift || true
builds=${*:-bin}
for b in $builds; do [ -f ".device/$b.tar.gz" ] && mkdir -p ".device/$b" && tar -xzf ".device/$b.tar.gz" -C ".device/$b"; done
nvidia-smi --query-gpu=name --format=csv,noheader; nproc
for round in $(seq "$rounds"); do
  for b in $builds; do
    echo "== round $round, .device/$b: transport, pinned landing"
    timeout 100 ".device/$b/dflash" bench-transport --device 0 --streams 1,2 \
      --json "$OUT/transport-$b-$round.json" 2>&1 | grep -v INFO | tail -4
    echo "== round $round, .device/$b: drafter step, 512 anchors"
    timeout 120 ".device/$b/dflash" bench-step --shape qwen3-8b --device 0 --anchors 512 --attention split --chunks 64 \
      --context-multiple 128 --batch-tokens 12288 --batches 8 --max-blocks 2048 --steps 8 --warmup 2 \
      --json "$OUT/step-512-$b-$round.json" 2>&1 | grep -v INFO | tail -2
  done
done
