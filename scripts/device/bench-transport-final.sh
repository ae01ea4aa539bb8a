#!/usr/bin/env bash
# One call on an H200 machine: the transport before the zero-copy data plane
# (.device/tx/dflash-drafter-old, glibc's default malloc and with freed memory
# kept mapped through GLIBC_TUNABLES) and after it (.device/tx/dflash-drafter,
# which keeps freed memory mapped itself), three rounds alternating; then the
# GPU service test with the new binaries (.device/bin). Results go to $OUT.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
B=.device/tx
KEEP="glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296"
nproc
for round in 1 2 3; do
  echo "== round $round: before, default malloc, pinned"
  timeout 120 $B/dflash-drafter-old bench-transport --device 0 --streams 1,2,4 --json "$OUT/old-$round.json" 2>&1 | grep -v INFO | tail -4
  echo "== round $round: before, memory kept mapped, pinned"
  GLIBC_TUNABLES=$KEEP timeout 120 $B/dflash-drafter-old bench-transport --device 0 --streams 1,2,4 --json "$OUT/old-keep-$round.json" 2>&1 | grep -v INFO | tail -4
  echo "== round $round: after, pinned"
  timeout 120 $B/dflash-drafter bench-transport --device 0 --streams 1,2,4 --json "$OUT/new-$round.json" 2>&1 | grep -v INFO | tail -4
  echo "== round $round: after, host landing"
  timeout 120 $B/dflash-drafter bench-transport --streams 1,2 --json "$OUT/new-host-$round.json" 2>&1 | grep -v INFO | tail -3
done
if [ -x .device/bin/deps/gpu ]; then
  timeout 300 .device/bin/deps/gpu --ignored --test-threads 1 services_train_on_one_gpu 2>&1 | grep -E "^test |test result|panicked|Error" | head -20
fi
