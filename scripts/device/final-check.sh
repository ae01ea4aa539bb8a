#!/usr/bin/env bash
# One call on an H200 machine with the final binaries (.device/bin, the
# allocator setting applied when serving on GPUs): the transport benchmark
# (pinned landing, two rounds) and the GPU service test. Results in $OUT.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
for round in 1 2; do
  echo "== round $round: transport, pinned landing (GPU 0)"
  timeout 120 .device/bin/dflash-drafter bench-transport --device 0 --streams 1,2,4 --json "$OUT/final-$round.json" 2>&1 | grep -v INFO | tail -4
done
timeout 300 .device/bin/deps/gpu --ignored --test-threads 1 services_train_on_one_gpu 2>&1 | grep -E "^test |test result|panicked" | head
