#!/usr/bin/env bash
# One GPU (issue 40, where the drafter step's time goes): bench-step on the
# Qwen3-8B-shape drafter (5 layers, block 16, split attention, CHUNKS
# attention chunks, default 64: dense chunks run out of memory at 512
# anchors on an 80 GB card) at 512 and 256 anchors, each followed by one step under
# libtorch's profiler, its kernels sorted by class (layer matmuls, LM head,
# attention, loss, optimizer, norms, elementwise, host gaps).
#   scripts/device/drafter-profile-gpu.sh   (binary in .device/bin/dflash)
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
B=.device/bin
for anchors in ${ANCHORS:-512 256}; do
  timeout 200 $B/dflash bench-step --shape qwen3-8b --device 0 --layers 5 --block 16 --anchors $anchors \
    --chunks ${CHUNKS:-64} --attention split --batches 2 --steps 4 --warmup 2 --profile \
    --json "$OUT/step-profile-$anchors.json" > "$OUT/step-profile-$anchors.log" 2>&1
  echo "== $anchors anchors (exit $?)"
  grep -v "^ERROR\|^WARNING\|^STAGE\|^\[W" "$OUT/step-profile-$anchors.log" | tail -60
done
