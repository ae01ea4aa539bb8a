#!/usr/bin/env bash
# One call on a 2-GPU H200 machine after a change to the services' data
# path or the training step: the ignored GPU tests, the drafter step for
# chunk sizes 64 and 32, then the end-to-end run against the drafter alone
# with the default context padding. Binaries in .device/bin (the test
# binary in .device/bin/deps); results go to $OUT.
set -u
cd "$(dirname "$0")/../.."
bash scripts/device/gpu-tests.sh
. scripts/device/env.sh
echo "== drafter step (GPU 1), 512 anchors, 12 distinct batches, chunks 64 and 32"
timeout 200 .device/bin/dflash-drafter bench-step --shape qwen3-8b --device 1 --anchors 512 --chunks 64,32 \
  --batch-tokens 12288 --batches 12 --max-blocks 2048 --steps 12 --warmup 2 --json "$OUT/chunks.json" 2>&1 | grep -v INFO | tail -3
PADS=128 bash scripts/device/bench-e2e.sh
