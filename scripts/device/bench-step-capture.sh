#!/usr/bin/env bash
# One call on an H200 machine: before (.device/old) and after (.device/bin)
# a change to the training step or the target forward: the drafter step at
# 512 anchors over 12 distinct batches and over 4 warm ones, and the capture
# benchmark (off / async / sync). Stripped release builds; results in $OUT.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
. scripts/device/before-after.sh
for build in old bin; do
  drafter_step $build 512 64 $build
  drafter_step $build 512 64 warm-$build 4 8
done
for build in old bin; do capture $build 5; done
