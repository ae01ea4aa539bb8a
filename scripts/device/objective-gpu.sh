#!/usr/bin/env bash
# D-PACE against cross-entropy on one H200 (issue 21, item 3): a DFlash2
# drafter (block 8, 2 layers) trained on the 1,199 SmolLM2-answered chitchat
# conversations (.device/g/train.jsonl, as dflash2-gpu.sh returns them) with
# training.loss = "ce" and "dpace", each scored in f32 on the GPU on held-out
# chitchat and MT-Bench (two per category). The target as in
# code-mix-gpu.sh (the SmolLM2 wheel in parts).
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
. scripts/device/smollm2-eval.sh
B=${DFLASH_BIN:-.device/bin}
smollm2_model
cp .device/g/train.jsonl /tmp/g/chat.jsonl
# D-PACE weighs the slots itself (drafter.gamma must be unset); block 8's
# default gamma for CE is the config's 4.0.
sed '/^gamma/d' deploy/configs/h200-smollm2.toml > /tmp/g/run.toml
for loss in ce dpace; do
  rm -rf /tmp/g/up /tmp/g/checkpoints
  start=$(date +%s)
  timeout 150 $B/dflash up --config /tmp/g/run.toml --workdir /tmp/g/up --no-final-eval \
    --set 'drafter.variant="dflash2"' --set 'data.train_path="/tmp/g/chat.jsonl"' \
    --set "training.loss=\"$loss\"" > "$OUT/up-$loss.log" 2>&1
  echo "$loss: up exit $? in $(( $(date +%s) - start )) s"
  grep -E "step [0-9]+/" "$OUT/up-$loss.log" | tail -1
  ckpt=/tmp/g/checkpoints/$(cat /tmp/g/checkpoints/latest)
  smollm2_eval "$ckpt" "$loss" chat mt
done
