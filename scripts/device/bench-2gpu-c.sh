#!/usr/bin/env bash
# Third call: drafter step with cuDNN attention on vs off on varying
# batches, and the device-to-host copy alone (pinned vs pageable).
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
B=.device/bin
for a in 256 512; do
  for flag in "" "--cudnn-attention"; do
    timeout 150 $B/dflash-drafter bench-step --shape qwen3-8b --device 0 --anchors $a --chunks 64 --batch-tokens 12288 \
      --batches 4 --max-blocks 2048 --steps 8 --warmup 2 $flag 2>&1 | grep -E "cuDNN|^ +[0-9]" | sed 's/.*cuDNN attention \([a-z]*\).*/cuDNN \1/'
  done
done
timeout 120 $B/dflash-target bench-capture --shape qwen3-8b --device 0 --modes off --batches 2 --warmup 1 --profile 2>&1 | grep -E "device-to-host|off "
