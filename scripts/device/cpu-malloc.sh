#!/usr/bin/env bash
# One call on an H200 host, CPU only (2 cores pinned with taskset, like the
# dev machine): does keeping freed memory mapped (the binaries' default) slow
# libtorch on the CPU? The CPU drafter's training step (SmolLM2 shape, 2
# layers, 32 anchors, 1,024-token batches) and the CPU target's greedy
# regeneration of 32 prompts on a random SmolLM2-shaped model, each with the
# setting and with glibc's defaults (GLIBC_TUNABLES=glibc.malloc.perturb=0),
# three rounds alternating. Results in $OUT.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
B=.device/bin
taskset -c 0,1 $B/dflash-target prepare-synthetic --shape smollm2-135m --model-dir /tmp/sm/model \
  --dataset /tmp/sm/data.jsonl --samples 64 --seed 1 2>&1 | tail -1
for round in 1 2 3; do
  for mode in kept default; do
    if [ $mode = default ]; then export GLIBC_TUNABLES=glibc.malloc.perturb=0; else unset GLIBC_TUNABLES; fi
    echo "== round $round, $mode: drafter step"
    timeout 120 taskset -c 0,1 $B/dflash-drafter bench-step --shape smollm2-135m --device cpu --threads 2 --layers 2 \
      --block 8 --anchors 32 --batch-tokens 1024 --batches 4 --steps 10 --warmup 2 2>&1 | grep -v INFO | tail -1
    echo "== round $round, $mode: regenerate 32 prompts"
    s=$(date +%s%N)
    timeout 200 taskset -c 0,1 $B/dflash-target regenerate --model /tmp/sm/model --input /tmp/sm/data.jsonl \
      --output /tmp/sm/out-$mode.jsonl --limit 32 --max-new-tokens 48 --threads 1 > /dev/null 2>&1
    echo "exit $? in $(( ($(date +%s%N) - s) / 1000000 )) ms"
  done
done
unset GLIBC_TUNABLES
