#!/usr/bin/env bash
# One call on a 2-GPU H200 machine: the GPU tests (one GPU; data-parallel
# drafters on two), the end-to-end run (target GPU 0, drafter GPU 1,
# Qwen3-8B-shaped target), drafter host memory over that run, the capture
# profile, and transport with several streams. Results go to $OUT.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
B=.device/bin
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc

echo "== GPU tests"
timeout 300 .device/bin/deps/gpu --ignored --test-threads 1 > "$OUT/gpu-tests.log" 2>&1
echo "gpu tests exit $?"; grep -E "^test |test result" "$OUT/gpu-tests.log"

echo "== end to end: Qwen3-8B-shaped target on GPU 0, 5-layer drafter on GPU 1"
rm -rf /tmp/q8 runs
t0=$(date +%s)
$B/dflash-target prepare-synthetic --shape qwen3-8b --bf16 --gpu 0 --model-dir /tmp/q8/model \
  --dataset /tmp/q8/data.jsonl --samples 600 --answer-tokens 500 2900 --seed 1 2>&1 | tail -1
echo "prepared in $(( $(date +%s) - t0 )) s"
( while sleep 5; do p=$(pgrep -f "dflash-drafter serve" | head -1); [ -n "$p" ] && echo "$(date +%s) $(ps -o rss= -p $p)"; done ) > "$OUT/drafter-rss.txt" 2>/dev/null &
RSS=$!
timeout 330 $B/dflash up --config deploy/configs/h200-qwen3-8b-e2e.toml --workdir /tmp/q8/up > "$OUT/e2e.log" 2>&1
echo "e2e exit $?"
kill $RSS 2>/dev/null
grep -E "step [0-9]+/|forward busy|pinned|completed|ERROR|checkpoint .* written" "$OUT/e2e.log" | tail -14

echo "== capture profile"
timeout 120 $B/dflash-target bench-capture --shape qwen3-8b --device 0 --modes off --batches 3 --warmup 1 --profile 2>&1 | tail -10
echo "== transport"
timeout 150 $B/dflash-drafter bench-transport --streams 1,2,4,8 --json "$OUT/transport.json" 2>&1 | tail -6
