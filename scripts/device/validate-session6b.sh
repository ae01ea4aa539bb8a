#!/usr/bin/env bash
# Second call of session 6 on an H200: the CUDA tests (the bf16 cross-entropy
# on CUDA, the split attention, the fused AdamW; the services on one GPU), the
# capture benchmark with per-forward GPU timelines and the host's receipt
# times (is the async gap on the GPU or on the host clock?), and the drafter
# step at 256 anchors. Binaries in .device/bin. Results in $OUT.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
. scripts/device/before-after.sh
echo "== CUDA tests"
timeout 200 .device/bin/models-tests --ignored 2>&1 | grep -E "^test |test result"
timeout 240 .device/bin/deps/gpu --ignored --exact services_train_on_one_gpu 2>&1 | grep -E "^test |test result"
for round in 1 2; do
  capture bin r$round
done
echo "== drafter step, split attention, 256 anchors"
timeout 200 .device/bin/dflash-drafter bench-step --shape qwen3-8b --device 0 --attention split --anchors 256 \
  --chunks 16 --context-multiple 128 --batch-tokens 12288 --batches 12 --max-blocks 2048 --steps 12 \
  --warmup 2 --json "$OUT/step-256.json" 2>&1 | grep -v INFO | tail -2
nvidia-smi --query-gpu=name,memory.used --format=csv
