#!/usr/bin/env bash
# One GPU (issue 40, training.precision = "fp8"): the ignored CUDA test of
# the FP8 step against the bf16 and f32 steps, then bench-step on the
# Qwen3-8B-shape drafter (5 layers, block 16, split attention, CHUNKS
# attention chunks, default 64) with bf16 and fp8 matmuls side by side at
# 512 and 256 anchors, then the per-matmul FP8 bench (fp8_linear_bench.py).
#   scripts/device/fp8-gpu.sh   (binary in .device/bin/dflash, test binary
#                                in .device/bin/deps/training)
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
B=.device/bin
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 120 $B/deps/training --ignored --exact an_fp8_step_stays_within_a_stated_tolerance_of_the_bf16_and_f32_steps \
  --nocapture 2>&1 | grep -E "^test |test result|panicked|relative to|Error|error" | head -20
timeout 300 $B/dflash bench-step --shape qwen3-8b --device 0 --layers 5 --block 16 --anchors ${ANCHORS:-512,256} \
  --chunks ${CHUNKS:-64} --attention split --precision bf16,fp8 --batches ${BATCHES:-4} --steps ${STEPS:-8} --warmup 2 \
  ${PROFILE:+--profile} --json "$OUT/step-fp8.json" > "$OUT/step-fp8.log" 2>&1
echo "== bench-step (exit $?)"
grep -v "^ERROR\|^WARNING\|^STAGE\|^\[W" "$OUT/step-fp8.log" | tail -${TAIL:-12}
[ -n "${LINEAR:-}" ] && timeout 120 python3 scripts/device/fp8_linear_bench.py 2>&1 | tail -14
exit 0
