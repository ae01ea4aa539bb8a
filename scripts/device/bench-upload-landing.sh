#!/usr/bin/env bash
# One call on an H200 machine: before/after a change to the two CPU-side
# hot paths, with stripped release builds in .device/old (before) and
# .device/bin (after):
#  - target capture with postprocess off / async / sync (the ids upload);
#  - the hidden-state stream against raw TCP, landing in the GPU drafter's
#    pooled pinned buffers (the landing thread).
# Two rounds each, alternating builds, so drift shows. Results go to $OUT.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
. scripts/device/before-after.sh
nproc
for round in 1 2; do
  for build in old bin; do capture $build $round; done
done
for round in 1 2; do
  for build in old bin; do transport $build $round; done
done
