#!/usr/bin/env bash
# Hybrid targets (Qwen3.5 / Qwen3.6, Qwen3-Next) on one H200: the fixtures'
# CUDA forwards against transformers' references, then capture throughput,
# MFU and where a forward's time goes for the Qwen3.5-27B and -35B-A3B
# shapes, beside transformers' own forward of the same random model and
# batches with its torch path and with flash-linear-attention 0.6.0
# (carried as wheels in .whl). Binaries come prebuilt in .device/bin, the
# model tests' binary in .device/bin/deps/families.
#   scripts/device/hybrid-gpu.sh [shapes...]   (default: qwen3.5-27b qwen3.5-35b-a3b)
# HF=0 skips transformers' forwards, FIXTURES=0 the fixture checks;
# BEFORE=1 also runs each shape with the delta rule and convolution as
# libtorch ops (DFLASH_DELTA_RULE=torch), before the fused kernels.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
B=.device/bin
shapes=${*:-qwen3.5-27b qwen3.5-35b-a3b}
HF_BATCHES=${HF_BATCHES:-3}
HF=${HF:-1}
FIXTURES=${FIXTURES:-1}
BEFORE=${BEFORE:-0}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
mkdir -p /tmp/fla && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fla .whl/*.whl \
  && echo "fla wheels installed" || echo "no fla wheels"
[ "$FIXTURES" = 1 ] && echo "== hybrid fixtures on cuda:0 vs transformers"
[ "$FIXTURES" = 1 ] && for n in tiny-qwen3-next tiny-qwen3.5 tiny-qwen3.5-vl tiny-qwen3.5-moe tiny-qwen3.5-moe-vl; do
  d=tests/fixtures/$n
  ids=$(python3 -c "from safetensors.torch import load_file; print(','.join(map(str, load_file('$d/reference.safetensors')['ids'].tolist())))")
  for dt in f32 bf16; do
    timeout 60 $B/dflash-target inspect --model "$d" --device 0 --dtype $dt --ids "$ids" --layers 0,1,2,3 --json /tmp/i.json > /tmp/i.log 2>&1 \
      && echo -n "$dt " && python3 scripts/reference/compare_inspect.py "$d" /tmp/i.json || { echo "$n $dt FAILED"; tail -3 /tmp/i.log; }
  done
done
[ "$FIXTURES" = 1 ] && echo "== packed capture on cuda:0 (f32, bf16) vs transformers"
[ "$FIXTURES" = 1 ] && [ -x .device/bin/deps/families ] && DFLASH_FIXTURES=$PWD/tests/fixtures timeout 120 .device/bin/deps/families --ignored --test-threads 1 2>&1 \
  | grep -E "^test |test result|panicked|layer|outputs|states|fused|unavailable" | head -20
for s in $shapes; do
  if [ "$BEFORE" = 1 ]; then
    echo "== capture $s (dflash, rule as libtorch ops)"
    DFLASH_DELTA_RULE=torch timeout 240 $B/dflash bench-capture --shape "$s" --device 0 --layers 5 --batches 4 --warmup 1 \
      --modes async --profile --json "$OUT/capture-ops-$s.json" > "$OUT/capture-ops-$s.log" 2>&1; echo "exit $?"
    grep -A 40 "where a forward" "$OUT/capture-ops-$s.log" | grep -E "rule|conv|total" | head -12
    tail -3 "$OUT/capture-ops-$s.log"
  fi
  echo "== capture $s (dflash)"
  timeout 240 $B/dflash bench-capture --shape "$s" --device 0 --layers 5 --batches 4 --warmup 1 \
    --modes off,async --profile --json "$OUT/capture-$s.json" > "$OUT/capture-$s.log" 2>&1; echo "exit $?"
  grep -A 40 "where a forward" "$OUT/capture-$s.log" | grep -v "^device-to-host" | head -40
  tail -3 "$OUT/capture-$s.log"
  [ "$HF" = 1 ] || continue
  echo "== capture $s (transformers, torch path)"
  timeout 200 python3 scripts/reference/hf_capture.py --bench "$OUT/capture-$s.json" --batches "$HF_BATCHES" \
    --json "$OUT/hf-$s.json" 2>&1 | grep -v Warning | tail -2
  echo "== capture $s (transformers + flash-linear-attention)"
  PYTHONPATH=/tmp/fla timeout 240 python3 scripts/reference/hf_capture.py --bench "$OUT/capture-$s.json" --batches "$HF_BATCHES" \
    --json "$OUT/hf-fla-$s.json" 2>&1 | grep -v Warning | tail -2
done
