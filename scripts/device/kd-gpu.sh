#!/usr/bin/env bash
# Distillation on one H200 (issue 21, point 3): what training.loss = "kd"
# costs the drafter's step, against cross-entropy, at the Qwen3-8B shape.
#   scripts/device/kd-gpu.sh step
# Its quality on SmolLM2 is specforge-gpu.sh's KD=1 arm.
# Binaries in $DFLASH_BIN (default /tmp/dbin/bin).
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
B=${DFLASH_BIN:-/tmp/dbin/bin}
case ${1:?step} in
  step)
    for objective in ce kd; do
      timeout 240 $B/dflash bench-step --shape qwen3-8b --device 0 --anchors 512 --attention split --chunks 64 \
        --context-multiple 128 --batch-tokens 12288 --batches 12 --max-blocks 2048 --steps 12 --warmup 2 \
        --objective $objective --json "$OUT/step-$objective.json" 2>&1 | grep -v "^$" | tail -4
    done
    ;;
  *) echo "kd-gpu.sh: unknown phase '$1' (step)" >&2; exit 2 ;;
esac
