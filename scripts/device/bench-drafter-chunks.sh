#!/usr/bin/env bash
# One call on an H200 machine: the drafter step (Qwen3-8B-shaped 5-layer
# drafter) over 12 distinct batches, before (.device/old) and after
# (.device/bin) a change to the block attention, for several chunk sizes;
# then more rounds of the capture benchmark (off / async / sync) for both
# builds. Stripped release builds; results go to $OUT.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
. scripts/device/before-after.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc
drafter_step old 512 64 old-512
drafter_step bin 512 64,32,16 new-512
drafter_step bin 256 64,32,16 new-256
drafter_step old 256 64 old-256
for round in 3 4; do
  for build in old bin; do capture $build $round; done
done
