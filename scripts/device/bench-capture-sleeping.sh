#!/usr/bin/env bash
# One call on an H200: async capture with the postprocess worker spinning in
# the driver's synchronize (.device/old) against sleeping between event
# queries (.device/bin), alternated, two rounds each. Results in $OUT.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
. scripts/device/before-after.sh
for round in 1 2; do
  for build in old bin; do
    capture $build r$round
  done
done
