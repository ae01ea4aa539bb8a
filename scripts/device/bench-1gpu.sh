#!/usr/bin/env bash
# One call on a 1-GPU H200 machine (the device tool): environment, reference
# logits from transformers, a GPU smoke run of the services, and the
# capture / drafter-step / transport benchmarks. Binaries come prebuilt in
# .device/bin (stripped release builds); results go to $OUT.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
B=.device/bin
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; free -g | head -2;
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "== smoke: services on cuda:0 (synthetic target)"
rm -rf runs
timeout 120 $B/dflash up --config deploy/configs/cpu-synthetic.toml --prepare synthetic \
  --target-devices 0 --drafter-devices 0 --set devices.share_gpus=true --set model.dtype=\"auto\" --max-steps 30 > "$OUT/smoke.log" 2>&1
echo "smoke exit $?"; grep -E "step 30/|PACKED|SPLIT|pinned|completed|ERROR" "$OUT/smoke.log" | head -8

echo "== capture"
timeout 200 $B/dflash-target bench-capture --shape qwen3-8b --device 0 --layers 5 --batches 6 --warmup 2 \
  --json "$OUT/capture.json" 2>&1 | tail -8
echo "== drafter step"
for a in 256 512; do
  timeout 200 $B/dflash-drafter bench-step --shape qwen3-8b --device 0 --anchors $a --chunks 100000,64,16 \
    --max-blocks 2048 --steps 3 --warmup 1 --json "$OUT/step-$a.json" 2>&1 | tail -6
done
echo "== transport"
timeout 120 $B/dflash-drafter bench-transport --json "$OUT/transport.json" 2>&1 | tail -5
