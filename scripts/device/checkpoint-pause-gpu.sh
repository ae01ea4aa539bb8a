#!/usr/bin/env bash
# One GPU, one call (issue 40, checkpoints that do not stall): the disk's
# sequential rate (dd, one fdatasync), then bench-checkpoint's pause and
# write for the Qwen3-8B-shape drafter (15 GB: bf16 weights, f32 masters
# and moments) with this build (pinned buffers reused, writes straight
# from them, hashed on the way) and with BEFORE=1 also the build before
# (.device/bin/dflash-before: pageable snapshot, serialized copies, files
# read back to hash); then the
# CUDA tests of the checkpoint snapshot and the delta rule.
#   scripts/device/checkpoint-pause-gpu.sh   (binaries in .device/bin: dflash, dflash-before,
#                                              deps/checkpoints, deps/families)
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
B=.device/bin
DIR=${CKPT_DIR:-/tmp/ckpt-bench}
mkdir -p "$DIR"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
df -h "$DIR" | tail -1
echo "== the disk: dd 8 GiB, 64 MiB blocks, fdatasync"
dd if=/dev/zero of="$DIR/dd.bin" bs=64M count=${DD_BLOCKS:-128} conv=fdatasync 2>&1 | tail -1
rm -f "$DIR/dd.bin"
echo "== CUDA tests: the snapshot into pinned buffers"
[ -x $B/deps/checkpoints ] && timeout 120 $B/deps/checkpoints --ignored --test-threads 1 cuda 2>&1 | grep -E "^test |test result|panicked" | head
RUNS=("dflash ${ROUNDS:-2}")
[ "${BEFORE:-0}" = 1 ] && RUNS+=("dflash-before 1")
for run in "${RUNS[@]}"; do
  set -- $run
  echo "== bench-checkpoint, $1, $2 round(s)"
  timeout 280 $B/$1 bench-checkpoint --shape qwen3-8b --device 0 --rounds $2 --dir "$DIR" \
    --json "$OUT/checkpoint-$1.json" 2>&1 | tail -6
done
[ "${FAMILIES:-1}" = 1 ] || exit 0
echo "== CUDA tests: the delta rule and hybrid capture"
DFLASH_FIXTURES=$PWD/tests/fixtures timeout 150 $B/deps/families --ignored --test-threads 1 cuda > "$OUT/families-cuda.log" 2>&1
grep -E "^test |test result|panicked" "$OUT/families-cuda.log" | head -20
