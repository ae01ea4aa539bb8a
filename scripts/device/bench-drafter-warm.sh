#!/usr/bin/env bash
# One call on an H200 machine: the drafter step over 4 distinct batches,
# with a warm-up that visits each twice, so that every attention shape has
# its cuDNN plan before timing starts (the steady state of a long run);
# before (.device/old) and after (.device/bin) a change. Results in $OUT.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
. scripts/device/before-after.sh
drafter_step old 512 64 warm-old-512 4 8
drafter_step bin 512 64,32,16 warm-new-512 4 8
drafter_step bin 256 64,16 warm-new-256 4 8
drafter_step old 256 64 warm-old-256 4 8
