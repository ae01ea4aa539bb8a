#!/usr/bin/env bash
# The drafter group's step path on one H200: the drafter step at 512
# anchors alone (as a drafter outside a group) and as a one-member group over
# a real NCCL communicator formed through the group's store (agreement,
# gradient all-reduce, optimizer step), in alternating rounds; then the
# same step under the D-PACE objective. Results (JSON) go to $OUT.
#   scripts/device/group-of-one.sh [ROUNDS]   (binaries in .device/bin)
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
rounds=${1:-2}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
step() {  # step <json> <extra args...>
  local json=$1; shift
  timeout 200 .device/bin/dflash bench-step --shape qwen3-8b --device 0 --anchors 512 --attention split --chunks 64 \
    --context-multiple 128 --batch-tokens 12288 --batches 12 --max-blocks 2048 --steps 12 --warmup 2 \
    --json "$OUT/$json" "$@" 2>&1 | grep -v INFO | tail -3
}
for round in $(seq "$rounds"); do
  echo "== round $round: alone, then a group of one (NCCL through the store)"
  step "group-$round.json" --collective none,group-of-one
done
echo "== D-PACE objective"
step "dpace.json" --objective dpace
