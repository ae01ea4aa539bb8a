#!/usr/bin/env bash
# One call on an H200: the capture benchmark (off / async / sync) with the
# target keeping freed memory mapped (its default since the zero-copy data
# plane) and with glibc's default malloc behaviour (any malloc tunable in
# GLIBC_TUNABLES makes the binary leave glibc's settings alone; perturb=0 is
# glibc's default), two rounds alternating. Results in $OUT.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
for round in 1 2; do
  echo "== capture, freed memory kept mapped (r$round)"
  timeout 150 .device/bin/dflash-target bench-capture --shape qwen3-8b --device 0 --layers 5 \
    --batches 20 --warmup 3 --json "$OUT/capture-keep-r$round.json" 2>&1 | grep -v INFO | tail -5
  echo "== capture, glibc defaults (r$round)"
  GLIBC_TUNABLES=glibc.malloc.perturb=0 timeout 150 .device/bin/dflash-target bench-capture --shape qwen3-8b --device 0 --layers 5 \
    --batches 20 --warmup 3 --json "$OUT/capture-default-r$round.json" 2>&1 | grep -v INFO | tail -5
done
