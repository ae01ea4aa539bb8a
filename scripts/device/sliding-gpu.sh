#!/usr/bin/env bash
# Sliding-window drafter layers on one H200 (issue 21, point 2).
#   scripts/device/sliding-gpu.sh step      the step at the Qwen3-8B shape, 512 anchors, masked
#                                           attention (what sliding layers train with): 5 full
#                                           layers, then 4 of 5 sliding with a 1,024 window
#   scripts/device/sliding-gpu.sh quality   SmolLM2 block 8, 5 layers, 1,199 conversations, 228
#                                           steps: full attention against 4 sliding layers
#                                           (window 128) + 1 full, scored in f32 on the GPU
#                                           on $SETS (default "chat mt")
# Binaries in $DFLASH_BIN (default /tmp/dbin/bin); quality needs the data of
# `specforge-gpu.sh data` (it runs it when /tmp/g/train.jsonl is missing).
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
. scripts/device/smollm2-eval.sh
B=${DFLASH_BIN:-/tmp/dbin/bin}
case ${1:?step or quality} in
  step)
    for sliding in 0 4; do
      timeout 150 $B/dflash bench-step --shape qwen3-8b --device 0 --anchors 512 --attention masked --chunks 32 \
        --context-multiple 128 --batch-tokens 12288 --batches 4 --max-blocks 2048 --steps 6 --warmup 1 \
        --sliding-window $( [ $sliding = 0 ] && echo 0 || echo 1024 ) --sliding-layers $sliding \
        --json "$OUT/step-sliding-$sliding.json" 2>&1 | grep -v "^$" | tail -3
    done
    ;;
  quality)
    [ -f /tmp/g/train.jsonl ] || REGEN_BATCH=256 scripts/device/specforge-gpu.sh data || exit 1
    types='["sliding_attention","sliding_attention","sliding_attention","sliding_attention","full_attention"]'
    for arm in full sliding; do
      how=()
      [ $arm = sliding ] && how=(--set "drafter.layer_types=$types" --set drafter.sliding_window=128)
      rm -rf /tmp/g/up /tmp/g/checkpoints
      start=$(date +%s)
      timeout 120 $B/dflash up --config deploy/configs/h200-smollm2.toml --workdir /tmp/g/up --no-final-eval \
        --set drafter.block_size=8 --set drafter.num_layers=5 --set drafter.gamma=4.0 "${how[@]}" \
        > "$OUT/up-$arm.log" 2>&1
      echo "$arm: up exit $? in $(( $(date +%s) - start )) s"
      grep -E "step [0-9]+/" "$OUT/up-$arm.log" | tail -1 | cut -c1-160
      rm -rf /tmp/g/$arm && cp -r /tmp/g/checkpoints/$(cat /tmp/g/checkpoints/latest) /tmp/g/$arm
      smollm2_eval /tmp/g/$arm $arm ${SETS:-chat mt}
    done
    ;;
  *) echo "sliding-gpu.sh: unknown phase '$1' (step or quality)" >&2; exit 2 ;;
esac
