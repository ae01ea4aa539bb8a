#!/usr/bin/env bash
# The target zoo on one H200: CUDA forwards of every fixture against
# transformers' references (f32, and bf16 for the MoE ones), then capture
# throughput and MFU for the Qwen3-8B, Llama-3.1-8B and Qwen3-30B-A3B shapes
# (random bf16 weights, ~11K-token batches of 550-3072-token sequences).
# Binaries come prebuilt in .device/bin; results go to $OUT.
#   scripts/device/target-families.sh [shapes...]   (default: qwen3-8b llama3.1-8b qwen3-30b-a3b)
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
B=.device/bin
shapes=${*:-qwen3-8b llama3.1-8b qwen3-30b-a3b}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
python3 - <<'PY'
import torch
x = torch.randn(64, 32, device="cuda"); w = torch.randn(4, 32, 16, device="cuda")
offs = torch.tensor([10, 30, 30, 64], dtype=torch.int32, device="cuda")
for k in (torch.float32, torch.bfloat16):
    try:
        torch._grouped_mm(x.to(k), w.to(k), offs); print("grouped_mm", k, "ok")
    except Exception as e:
        print("grouped_mm", k, "fails:", str(e).splitlines()[0])
PY
echo "== fixtures on cuda:0 vs transformers"
for d in tests/fixtures/tiny-*/; do
  n=$(basename "$d")
  ids=$(python3 -c "from safetensors.torch import load_file; print(','.join(map(str, load_file('$d/reference.safetensors')['ids'].tolist())))")
  for dt in f32 bf16; do
    case "$dt:$n" in bf16:*moe*|bf16:*fp8*|f32:*) ;; *) continue;; esac
    timeout 60 $B/dflash-target inspect --model "$d" --device 0 --dtype $dt --ids "$ids" --layers 0,1 --json /tmp/i.json > /tmp/i.log 2>&1 \
      && echo -n "$dt " && python3 scripts/reference/compare_inspect.py "$d" /tmp/i.json || { echo "$n $dt FAILED"; tail -3 /tmp/i.log; }
  done
done
for s in $shapes; do
  echo "== capture $s"
  timeout 240 $B/dflash bench-capture --shape "$s" --device 0 --layers 5 --batches 6 --warmup 2 \
    --modes off,async --json "$OUT/capture-$s.json" > "$OUT/capture-$s.log" 2>&1; echo "exit $?"
  tail -4 "$OUT/capture-$s.log"
done
