#!/usr/bin/env bash
# One call on a 2-GPU H200 machine: the drafter step alone (GPU 1) and the
# end-to-end run (Qwen3-8B-shaped target on GPU 0, 5-layer drafter on GPU 1,
# 512 anchors), each with the context padded to a multiple of 1 (none) and
# of 128 (the default), so that the ratios compare runs of one machine and
# one session (PADS="128" runs only the default). Binaries prebuilt in
# .device/bin; results go to $OUT.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
B=.device/bin
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc

for pad in ${PADS:-1 128}; do
  echo "== drafter alone (GPU 1), 12 distinct batches, context multiple $pad"
  timeout 200 $B/dflash bench-step --shape qwen3-8b --device 1 --attention split --anchors 512 --chunks 16 --context-multiple $pad \
    --batch-tokens 12288 --batches 12 --max-blocks 2048 --steps 12 --warmup 2 --json "$OUT/step-$pad.json" 2>&1 | grep -v INFO | tail -1
done

rm -rf /tmp/q8 runs
$B/dflash prepare-synthetic --shape qwen3-8b --bf16 --gpu 0 --model-dir /tmp/q8/model \
  --dataset /tmp/q8/data.jsonl --samples 600 --answer-tokens 500 2900 --seed 1 2>&1 | tail -1
for pad in ${PADS:-1 128}; do
  echo "== end to end, context multiple $pad"
  rm -rf /tmp/q8/up /tmp/q8/checkpoints
  timeout 240 $B/dflash up --config deploy/configs/h200-qwen3-8b-e2e.toml --max-steps 50 --workdir /tmp/q8/up \
    --set training.context_pad_multiple=$pad > "$OUT/e2e-$pad.log" 2>&1
  echo "e2e exit $?"
  grep -E "step [0-9]+/" "$OUT/e2e-$pad.log" | grep -oE "step [0-9]+/50|[0-9]+ tok/s" | paste - - | tr '\n' ';'; echo
done
