#!/usr/bin/env bash
# One call on an H200 machine: chunk size and credits of the hidden-state
# stream with pinned landing (the GPU drafter's path). Binary in .device/tx.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
B=.device/tx
for chunk in 1 2 4 8 16; do
  for credits in 2 4; do
    echo "== chunk $chunk MiB, credits $credits"
    timeout 100 $B/dflash-drafter bench-transport --device 0 --streams 1,2 --chunk-mib $chunk --credits $credits 2>&1 | grep -E "^ +[0-9]"
  done
done
