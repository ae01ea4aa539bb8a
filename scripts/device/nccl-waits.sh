#!/usr/bin/env bash
# The drafter group's NCCL waits on one H200: the ignored NCCL tests of
# dflash-models (an init whose peer never comes fails after the timeout and
# the GPU goes on; a cancelled wait ends at once), the services on one GPU,
# and the drafter step alone against a one-member NCCL group whose every
# all-reduce is waited for within the collective timeout (ROUNDS rounds,
# alternating). Results (JSON) go to $OUT.
#   scripts/device/nccl-waits.sh [ROUNDS]   (binaries in .device/bin, test
#   binaries in .device/bin/deps: dflash_models-*, gpu)
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
rounds=${1:-2}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "== NCCL waits (dflash-models, ignored tests)"
timeout 120 .device/bin/deps/dflash_models-* --ignored --test-threads 1 nccl 2>&1 \
  | grep -E "^test |test result|panicked|assert" | head -20
echo "== services on one GPU"
PATH="$PWD/.device/bin:$PATH" timeout 250 .device/bin/deps/gpu --ignored --test-threads 1 services_train_on_one_gpu 2>&1 \
  | grep -E "^test |test result|panicked" | head -10
for round in $(seq "$rounds"); do
  echo "== round $round: alone, then a group of one (NCCL through the store, waited collectives)"
  timeout 200 .device/bin/dflash bench-step --shape qwen3-8b --device 0 --anchors 512 --attention split --chunks 64 \
    --context-multiple 128 --batch-tokens 12288 --batches 12 --max-blocks 2048 --steps 12 --warmup 2 \
    --json "$OUT/group-$round.json" --collective none,group-of-one 2>&1 | grep -v INFO | tail -3
done
