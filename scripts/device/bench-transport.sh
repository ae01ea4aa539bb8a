#!/usr/bin/env bash
# One call on an H200 machine: the hidden-state transport benchmark, before
# and after a change (.device/tx/dflash-drafter-old and dflash-drafter,
# stripped release builds), landing in heap memory and in the GPU drafter's
# pooled pinned buffers. Results go to $OUT.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
B=.device/tx
nproc
for round in 1 2; do
  echo "== round $round: before (heap landing)"
  timeout 150 $B/dflash-drafter-old bench-transport --streams 1,2,4,8 --json "$OUT/old-$round.json" 2>&1 | grep -v INFO | tail -5
  echo "== round $round: after, heap landing"
  timeout 150 $B/dflash-drafter bench-transport --streams 1,2,4,8 --json "$OUT/heap-$round.json" 2>&1 | grep -v INFO | tail -5
  echo "== round $round: after, pinned landing (GPU 0)"
  timeout 150 $B/dflash-drafter bench-transport --device 0 --streams 1,2,4,8 --json "$OUT/pinned-$round.json" 2>&1 | grep -v INFO | tail -5
done
