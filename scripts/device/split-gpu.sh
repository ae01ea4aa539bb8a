#!/usr/bin/env bash
# One GPU, one call: the fused gated norm's CUDA test and the hybrid
# fixtures' packed capture on the GPU; then capture throughput before
# (.device/bin/dflash-before, the previous commit's build) and after this
# change, alternating, for the Qwen3.5-27B and Qwen3-8B shapes whole, and
# split into two pipeline parts on the one GPU (the cost of a split less
# the copies between devices); the 35B-A3B shape after; transformers +
# flash-linear-attention on the 27B shape last (wheels in .whl).
#   scripts/device/split-gpu.sh
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
B=.device/bin
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "== CUDA tests (fused gated norm, fused rule, hybrid packed capture vs transformers)"
DFLASH_FIXTURES=$PWD/tests/fixtures timeout 120 $B/deps/families --ignored --test-threads 1 cuda 2>&1 \
  | grep -E "^test |test result|panicked|layer|outputs|states|fused|unavailable" | head -20
bench() { # label binary shape extra...
  local label=$1 bin=$2 s=$3; shift 3
  timeout 150 $bin bench-capture --shape "$s" --device 0 --layers 5 --batches 4 --warmup 1 --modes async "$@" \
    --json "$OUT/capture-$s-$label.json" > "$OUT/capture-$s-$label.log" 2>&1
  echo "$s $label (exit $?): $(grep -E '^ *async' "$OUT/capture-$s-$label.log" | tail -1)"
}
for s in qwen3.5-27b qwen3-8b; do
  echo "== capture $s: before / after / after in 2 parts, twice"
  for round in 1 2; do
    bench before-$round $B/dflash-before $s
    bench after-$round $B/dflash $s
    bench parts2-$round $B/dflash $s --parts 2
  done
done
echo "== where the 27B forward's time goes (after)"
bench profile $B/dflash qwen3.5-27b --profile
grep -A 40 "where a forward" "$OUT/capture-qwen3.5-27b-profile.log" | grep -v "^device-to-host" | head -30
bench after $B/dflash qwen3.5-35b-a3b
echo "== capture qwen3.5-27b (transformers + flash-linear-attention)"
mkdir -p /tmp/fla && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fla .whl/*.whl
PYTHONPATH=/tmp/fla timeout 200 python3 scripts/reference/hf_capture.py --bench "$OUT/capture-qwen3.5-27b-after-1.json" \
  --batches 2 --json "$OUT/hf-fla-qwen3.5-27b.json" 2>&1 | grep -v Warning | tail -2
