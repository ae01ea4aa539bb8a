#!/usr/bin/env bash
# gpt-oss, DeepSeek-V3-architecture and GLM-4 MoE targets on one GPU: the
# fixtures' CUDA forwards (f32 and bf16) against transformers' references,
# then capture throughput, MFU and where a forward's time goes for the
# gpt-oss-20b and Moonlight-16B-A3B shapes, beside transformers' own forward
# of the same random model and batches (gpt-oss with eager attention, which
# its sinks need). Binaries come prebuilt in .device/bin.
#   scripts/device/routed-gpu.sh [shapes...]   (default: gpt-oss-20b moonlight-16b-a3b)
# HF=0 skips transformers' forwards, FIXTURES=0 the fixture checks.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
B=.device/bin
shapes=${*:-gpt-oss-20b moonlight-16b-a3b}
HF_BATCHES=${HF_BATCHES:-3}
HF=${HF:-1}
FIXTURES=${FIXTURES:-1}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ "$FIXTURES" = 1 ]; then
  echo "== routed fixtures on cuda:0 vs transformers"
  for n in tiny-gpt-oss tiny-gpt-oss-mxfp4 tiny-deepseek-v3 tiny-deepseek-v3-fp8 tiny-moonlight tiny-glm4-moe; do
    d=tests/fixtures/$n
    ids=$(python3 -c "from safetensors.torch import load_file; print(','.join(map(str, load_file('$d/reference.safetensors')['ids'].tolist())))")
    for dt in f32 bf16; do
      layers=$(python3 -c "import json; print(','.join(map(str, range(json.load(open('$d/config.json'))['num_hidden_layers']))))")
      timeout 60 $B/dflash-target inspect --model "$d" --device 0 --dtype $dt --ids "$ids" --layers "$layers" --json /tmp/i.json > /tmp/i.log 2>&1 \
        && echo -n "$n $dt " && python3 scripts/reference/compare_inspect.py "$d" /tmp/i.json || { echo "$n $dt FAILED"; tail -3 /tmp/i.log; }
    done
  done
fi
for s in $shapes; do
  attn=sdpa
  case $s in gpt-oss*) attn=eager ;; esac
  echo "== capture $s (dflash)"
  timeout 200 $B/dflash bench-capture --shape "$s" --device 0 --layers 5 --batches 4 --warmup 1 \
    --modes off,async --profile --json "$OUT/capture-$s.json" > "$OUT/capture-$s.log" 2>&1; echo "exit $?"
  grep -A 40 "where a forward" "$OUT/capture-$s.log" | grep -v "^device-to-host" | head -30
  tail -3 "$OUT/capture-$s.log"
  [ "$HF" = 1 ] || continue
  echo "== capture $s (transformers, $attn attention)"
  timeout 200 python3 scripts/reference/hf_capture.py --bench "$OUT/capture-$s.json" --batches "$HF_BATCHES" --attn $attn \
    --json "$OUT/hf-$s.json" 2>&1 | grep -v Warning | tail -2
done
