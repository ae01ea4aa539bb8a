#!/usr/bin/env bash
# One call on a 2-GPU H200 machine after a change to the services' data
# path: the ignored GPU tests, then the end-to-end run against the drafter
# alone with the default context padding. Binaries in .device/bin (the test
# binary in .device/bin/deps); results go to $OUT.
set -u
cd "$(dirname "$0")/../.."
bash scripts/device/gpu-tests.sh
PADS=128 bash scripts/device/bench-e2e.sh
