#!/usr/bin/env bash
# One call on an H200 machine: the transport before/after the zero-copy data
# plane (.device/tx/dflash-drafter-old and dflash-drafter), each with glibc's
# default malloc settings and with freed memory kept mapped (mmap threshold
# 32 MiB, no trimming), pinned landing on GPU 0. Results go to $OUT.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
B=.device/tx
KEEP="glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296"
for round in 1 2; do
  for bin in dflash-drafter-old dflash-drafter; do
    echo "== round $round: $bin, default malloc"
    timeout 120 $B/$bin bench-transport --device 0 --streams 1,2,4 --json "$OUT/$bin-default-$round.json" 2>&1 | grep -v INFO | tail -4
    echo "== round $round: $bin, memory kept mapped"
    GLIBC_TUNABLES=$KEEP timeout 120 $B/$bin bench-transport --device 0 --streams 1,2,4 --json "$OUT/$bin-keep-$round.json" 2>&1 | grep -v INFO | tail -4
  done
done
