#!/usr/bin/env bash
# One GPU, one call (issue 36): the delta rule's UT prep and outputs with
# every load of a tile in flight at once (RowTile), the scaling four values
# a step and the block rows of T = L^-1 with compile-time bounds. First the
# CUDA tests (the rule against the f64 recurrence, the hybrid fixtures'
# capture against transformers), then the kernels alone before and after
# (scripts/device/profile_ut_prep.py: time, equal outputs, UT prep's phases),
# then capture throughput of the build before (.device/bin/dflash-before)
# and after, alternated, and where the 35B-A3B forward's time goes.
#   scripts/device/rule-loads-gpu.sh   (binaries in .device/bin: dflash, dflash-before, deps/families;
#                                        the source before in .device/variants/base.cu)
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
B=.device/bin
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "== CUDA tests"
DFLASH_FIXTURES=$PWD/tests/fixtures timeout 150 $B/deps/families --ignored --test-threads 1 --nocapture cuda 2>&1 \
  | grep -E "^test |test result|panicked|within|unavailable" | head -40
echo "== the kernels alone: after, before"
timeout 120 python3 scripts/device/profile_ut_prep.py common/models/csrc/delta_rule.cu .device/variants/base.cu 2>&1 | tail -12
bench() { # label binary shape extra...
  local label=$1 bin=$2 s=$3; shift 3
  local t0=$SECONDS
  timeout 150 $B/$bin bench-capture --shape "$s" --device 0 --layers 5 --batches 4 \
    --warmup 1 --modes async "$@" --json "$OUT/capture-$s-$label.json" > "$OUT/capture-$s-$label.log" 2>&1
  echo "$s $label (exit $?, $((SECONDS - t0)) s): $(grep -E '^ *async' "$OUT/capture-$s-$label.log" | tail -1)"
}
echo "== capture: after / before, alternated"
for round in 1 2; do
  bench after-$round dflash qwen3.5-35b-a3b
  bench before-$round dflash-before qwen3.5-35b-a3b
done
bench after-1 dflash qwen3.5-27b
bench before-1 dflash-before qwen3.5-27b
echo "== where the 35B-A3B forward's time goes"
bench profile-after dflash qwen3.5-35b-a3b --profile
grep -A 40 "where a forward" "$OUT/capture-qwen3.5-35b-a3b-profile-after.log" | grep -v "^device-to-host" | head -18
