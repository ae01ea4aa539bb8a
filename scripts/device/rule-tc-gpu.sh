#!/usr/bin/env bash
# One GPU, one call (issue 36): the delta rule's scan and outputs on tensor
# cores, the fused row kernels (f32-scale RMSNorm, MoE un-permute, SwiGLU)
# and the vectorized convolution. First the CUDA tests (the fused rule
# against the f64 recurrence at dk 128 on tensor cores and dk 16 on CUDA
# cores, the row kernels and the gated norm against the ops, the hybrid
# fixtures' packed capture against transformers); then capture throughput,
# alternating: everything new, without the row kernels
# (DFLASH_FUSED_OPS=off), and also the rule on CUDA cores
# (DFLASH_DELTA_RULE=cuda-cores), for the Qwen3.5-35B-A3B and 27B shapes
# (and Qwen3-30B-A3B, whose MoE block the row kernels also serve); then
# where each 35B-A3B forward's time goes.
#   scripts/device/rule-tc-gpu.sh        (binaries in .device/bin: dflash, deps/families)
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
B=.device/bin
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "profilers: $(command -v nsys ncu 2>/dev/null | tr "\n" " ")"
echo "== CUDA tests"
DFLASH_FIXTURES=$PWD/tests/fixtures timeout 150 $B/deps/families --ignored --test-threads 1 --nocapture cuda 2>&1 \
  | grep -E "^test |test result|panicked|within|unavailable" | head -40
bench() { # label "ENV=.. ENV=.." shape extra...
  local label=$1 envs=$2 s=$3; shift 3
  local t0=$SECONDS
  env $envs timeout 150 $B/dflash bench-capture --shape "$s" --device 0 --layers 5 --batches 4 \
    --warmup 1 --modes async "$@" --json "$OUT/capture-$s-$label.json" > "$OUT/capture-$s-$label.log" 2>&1
  echo "$s $label (exit $?, $((SECONDS - t0)) s): $(grep -E '^ *async' "$OUT/capture-$s-$label.log" | tail -1)"
}
NEW="DFLASH_DELTA_RULE=fused DFLASH_FUSED_OPS=on"
NOROW="DFLASH_DELTA_RULE=fused DFLASH_FUSED_OPS=off"
OLD="DFLASH_DELTA_RULE=cuda-cores DFLASH_FUSED_OPS=off"
echo "== capture: new / without the fused row kernels / also the rule on CUDA cores"
for round in 1 2; do
  for s in qwen3.5-35b-a3b qwen3.5-27b; do
    bench new-$round "$NEW" $s
    bench old-$round "$OLD" $s
  done
done
bench norow-1 "$NOROW" qwen3.5-35b-a3b
bench new-1 "$NEW" qwen3-30b-a3b
bench norow-1 "$NOROW" qwen3-30b-a3b
echo "== where the 35B-A3B forward's time goes"
bench profile-new "$NEW" qwen3.5-35b-a3b --profile
grep -A 40 "where a forward" "$OUT/capture-qwen3.5-35b-a3b-profile-new.log" | grep -v "^device-to-host" | head -18
echo "== the MoE block of the 35B-A3B shape, stage by stage (PyTorch ops)"
timeout 120 python3 scripts/device/profile_moe.py qwen3.5-35b-a3b 2>&1 | tail -12
