#!/usr/bin/env bash
# One call on a 2-GPU H200 machine: the ignored GPU tests (services on one
# GPU; two data-parallel drafter replicas over NCCL with identical weights).
# The stripped test binary sits in .device/bin/deps with the release binaries
# it starts in .device/bin.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 400 .device/bin/deps/gpu --ignored --test-threads 1 2>&1 | grep -E "^test |test result|panicked|Error" | head -20
