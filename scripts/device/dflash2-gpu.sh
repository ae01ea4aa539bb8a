#!/usr/bin/env bash
# DFlash2 against DFlash on one H200 (issue 21).
#
#   scripts/device/dflash2-gpu.sh step
#     The training step on the Qwen3-8B shape (5-layer drafter, 512 anchors,
#     split attention): DFlash block 16, DFlash2 block 16, DFlash2 block 8.
#   scripts/device/dflash2-gpu.sh conv
#     The block convolution's GPU kernels: their CUDA test (the models
#     crate's test binary in $DFLASH_BIN/deps/models_lib), then DFlash block
#     16 against DFlash2 block 16 with the kernels and without them
#     (DFLASH_FUSED_OPS=off: the libtorch passes), twice each, alternated,
#     and one profiled DFlash2 step between the rounds.
#   scripts/device/dflash2-gpu.sh quality BLOCK LAYERS
#     SmolLM2-135M: the target converted from its wheel (in parts: the carry
#     limit), SmolLM2's answers to 1,200 chitchat prompts generated on the
#     GPU (prompts 600-619 stay held out), then DFlash and DFlash2 drafters
#     of LAYERS layers and block BLOCK trained on the same data
#     (deploy/configs/h200-smollm2.toml, 6 epochs), each scored in f32 on the
#     GPU on the held-out chitchat prompts and MT-Bench (two per category).
# Binaries in $DFLASH_BIN (default .device/bin); chitchat-prompts.jsonl and
# mt-bench-turn1.jsonl in .device/g.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
. scripts/device/smollm2-eval.sh
B=${DFLASH_BIN:-.device/bin}
phase=${1:?step or quality}

if [ "$phase" = step ]; then
  common=(--shape qwen3-8b --device 0 --anchors 512 --attention split --chunks 64 --context-multiple 128
    --batch-tokens 12288 --batches 12 --max-blocks 2048 --steps 12 --warmup 2)
  for run in "dflash 16" "dflash2 16" "dflash2 8"; do
    set -- $run
    echo "== $1 block $2"
    timeout 170 $B/dflash bench-step "${common[@]}" --variant "$1" --block "$2" \
      --json "$OUT/step-$1-$2.json" 2>&1 | grep -v INFO | tail -4
  done
  exit 0
fi

if [ "$phase" = conv ]; then
  # Everything also goes to $OUT/conv.log, so a call cut short keeps what ran.
  exec > >(tee "$OUT/conv.log") 2>&1
  nvidia-smi --query-gpu=name --format=csv,noheader
  timeout 120 $B/deps/models_lib --ignored --exact dflash2::tests::the_gpu_kernels_of_the_convolution_match_its_composite_form \
    2>&1 | grep -E "^test |test result|panicked|assert" | head -20
  common=(--shape qwen3-8b --device 0 --anchors 512 --attention split --chunks 64 --context-multiple 128
    --batch-tokens 12288 --max-blocks 2048 --warmup 2 --block 16)
  step() {
    echo "== $1 block 16, fused ops $2"
    DFLASH_FUSED_OPS=$2 timeout 100 $B/dflash bench-step "${common[@]}" --batches 12 --steps 12 --variant "$1" \
      --json "$OUT/conv-$1-$2-$SECONDS.json" 2>&1 | grep -v INFO | tail -1
  }
  step dflash2 on
  step dflash2 off
  step dflash on
  echo "== dflash2 block 16 profiled"
  timeout 120 $B/dflash bench-step "${common[@]}" --variant dflash2 --batches 2 --steps 3 --profile \
    --json "$OUT/conv-profile.json" 2>&1 | grep -v "INFO\|^ERROR\|^WARNING\|^STAGE\|^\[W" | tail -40
  step dflash2 on
  step dflash2 off
  step dflash on
  exit 0
fi

block=${2:-8}
layers=${3:-2}
smollm2_model
# Training data: SmolLM2's greedy answers to chitchat prompts 0-599 and
# 620-1219 (600-619 are the held-out prompts), answered on this GPU.
regen() {
  [ -f "$3" ] && return
  timeout 150 $B/dflash regenerate --model /tmp/g/model --input .device/g/chitchat-prompts.jsonl \
    --output "$3" --offset "$1" --limit "$2" --max-new-tokens 96 --batch-size 64 --device 0 2>&1 | tail -1
}
date
regen 0 600 /tmp/g/first.jsonl
regen 620 600 /tmp/g/more.jsonl
cat /tmp/g/first.jsonl /tmp/g/more.jsonl > /tmp/g/train.jsonl
cp /tmp/g/train.jsonl "$OUT/train.jsonl"
wc -l /tmp/g/train.jsonl
for variant in dflash dflash2; do
  name=$variant-b$block-l$layers
  rm -rf /tmp/g/up /tmp/g/checkpoints
  date
  start=$(date +%s)
  timeout 150 $B/dflash up --config deploy/configs/h200-smollm2.toml --workdir /tmp/g/up --no-final-eval \
    --set "drafter.variant=\"$variant\"" --set drafter.block_size=$block --set drafter.num_layers=$layers \
    --set "drafter.gamma=$( [ "$block" = 16 ] && echo 7.0 || echo 4.0 )" > "$OUT/up-$name.log" 2>&1
  echo "$name: up exit $? in $(( $(date +%s) - start )) s"
  grep -E "step [0-9]+/" "$OUT/up-$name.log" | tail -2
  ckpt=/tmp/g/checkpoints/$(cat /tmp/g/checkpoints/latest)
  smollm2_eval "$ckpt" "$name" chat mt
done
date
