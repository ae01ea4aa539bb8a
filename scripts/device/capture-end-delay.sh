#!/usr/bin/env bash
# One call on an H200: is the pipelined modes' extra time a per-batch cost or
# an end-of-run delay? The capture benchmark with per-forward GPU times in
# every mode (.device/bin; the forward loop waits for its last forwards'
# timings before it ends) against the build before (.device/v2), alternated.
# Results in $OUT.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
. scripts/device/before-after.sh
for round in 1 2; do
  capture bin r$round
  capture v2 r$round
done
