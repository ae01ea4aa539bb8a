#!/usr/bin/env bash
# One GPU (issue 40, long sequences): the drafter step on one sequence per
# batch of 8K, 16K and 32K tokens (Qwen3-8B-shape drafter, 5 layers, block 16,
# 512 anchors, split attention) at several attention chunkings (blocks per
# group: the group's shared context prefix is gathered once per group, and
# each block's band from the group's first anchor to its own once per block,
# so the chunking trades the two), then one profiled step at 32K.
#   scripts/device/long-seq-gpu.sh   (binary in .device/bin/dflash)
#   LENS="8192 32768" CHUNKS=64,16 PROFILE_CHUNKS=16 scripts/device/long-seq-gpu.sh
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
B=${DFLASH_BIN:-.device/bin}
for len in ${LENS:-8192 16384 32768}; do
  timeout ${STEP_TIMEOUT:-150} $B/dflash bench-step --shape qwen3-8b --device 0 --layers 5 --block 16 --anchors 512 \
    --chunks ${CHUNKS:-64,32,16} --attention split --batch-tokens $len --min-len $len --max-len $len \
    --batches ${BATCHES:-3} --steps ${STEPS:-6} --warmup 2 --json "$OUT/long-$len.json" > "$OUT/long-$len.log" 2>&1
  echo "== $len tokens (exit $?)"
  grep -v "^ERROR\|^WARNING\|^STAGE\|^\[W\|INFO" "$OUT/long-$len.log" | tail -${TAIL:-6}
done
if [ -n "${PROFILE_CHUNKS:-}" ]; then
  len=${PROFILE_LEN:-32768}
  timeout 150 $B/dflash bench-step --shape qwen3-8b --device 0 --layers 5 --block 16 --anchors 512 \
    --chunks $PROFILE_CHUNKS --attention split --batch-tokens $len --min-len $len --max-len $len \
    --batches 1 --steps 2 --warmup 2 --profile --json "$OUT/long-profile.json" > "$OUT/long-profile.log" 2>&1
  echo "== profile, $len tokens, chunks $PROFILE_CHUNKS (exit $?)"
  grep -v "^ERROR\|^WARNING\|^STAGE\|^\[W\|INFO" "$OUT/long-profile.log" | tail -40
fi
exit 0
