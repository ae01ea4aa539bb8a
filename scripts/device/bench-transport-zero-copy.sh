#!/usr/bin/env bash
# One call on an H200 machine: the hidden-state transport before and after
# the zero-copy data plane (.device/tx/dflash-drafter-old and dflash-drafter,
# stripped release builds), alternating builds, landing in the GPU drafter's
# pooled pinned buffers and in pooled host buffers. Results go to $OUT.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
B=.device/tx
nproc
for round in 1 2 3; do
  echo "== round $round: before, pinned landing (GPU 0)"
  timeout 120 $B/dflash-drafter-old bench-transport --device 0 --streams 1,2,4 --json "$OUT/old-pinned-$round.json" 2>&1 | grep -v INFO | tail -4
  echo "== round $round: after, pinned landing (GPU 0)"
  timeout 120 $B/dflash-drafter bench-transport --device 0 --streams 1,2,4 --json "$OUT/new-pinned-$round.json" 2>&1 | grep -v INFO | tail -4
  echo "== round $round: before, host landing"
  timeout 120 $B/dflash-drafter-old bench-transport --streams 1,2 --json "$OUT/old-host-$round.json" 2>&1 | grep -v INFO | tail -3
  echo "== round $round: after, host landing"
  timeout 120 $B/dflash-drafter bench-transport --streams 1,2 --json "$OUT/new-host-$round.json" 2>&1 | grep -v INFO | tail -3
done
