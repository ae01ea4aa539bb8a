#!/usr/bin/env bash
# One call on an H200 machine for the split (mask-free) block attention:
# its CUDA test against the masked attention, then the drafter step at 512
# and 256 anchors with the chunked mask (64 blocks per call, the previous
# default) and with the split attention at several group sizes, over 12
# distinct batches, and warm (4 batches, every shape seen before timing).
# Binaries in .device/bin. Results in $OUT.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
echo "== split attention on CUDA against the masked attention"
timeout 120 .device/bin/models-tests --ignored --exact \
  split_attention::tests::split_attention_on_cuda_matches_the_masked_attention 2>&1 | tail -4
step() { # <attention> <anchors> <chunks> <tag> [batches] [warmup]
  echo "== drafter step: $1 attention, $2 anchors, chunks $3, ${5:-12} batches, warmup ${6:-2}"
  timeout 300 .device/bin/dflash-drafter bench-step --shape qwen3-8b --device 0 --attention "$1" \
    --anchors "$2" --chunks "$3" --context-multiple 128 --batch-tokens 12288 --batches "${5:-12}" \
    --max-blocks 2048 --steps 12 --warmup "${6:-2}" --json "$OUT/step-$4.json" 2>&1 | grep -v INFO | tail -5
}
step ${SPLIT_512:-split} 512 ${GROUPS_512:-16,32} split-512
step masked 512 64 masked-512
step split 512 16 split-512-warm 4 8
step masked 512 64 masked-512-warm 4 8
step split,masked 256 16,64 both-256
nvidia-smi --query-gpu=name,memory.used --format=csv
