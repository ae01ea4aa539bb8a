#!/usr/bin/env bash
# One call on a 2-GPU H200 machine with the zero-copy data plane's binaries
# (.device/bin): both ignored GPU tests, the drafter step alone (GPU 1) and
# the end-to-end run (Qwen3-8B-shaped target on GPU 0, 5-layer drafter on
# GPU 1, 512 anchors) with the drafter's resident memory sampled every 5 s.
# Results go to $OUT.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
B=.device/bin
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc
echo "== GPU tests"
timeout 300 $B/deps/gpu --ignored --test-threads 1 2>&1 | grep -E "^test |test result|panicked" | head -20
echo "== drafter alone (GPU 1), 12 distinct batches"
timeout 200 $B/dflash-drafter bench-step --shape qwen3-8b --device 1 --attention split --anchors 512 --chunks 16 \
  --batch-tokens 12288 --batches 12 --max-blocks 2048 --steps 12 --warmup 2 --json "$OUT/step.json" 2>&1 | grep -v INFO | tail -1
rm -rf /tmp/q8 runs
$B/dflash-target prepare-synthetic --shape qwen3-8b --bf16 --gpu 0 --model-dir /tmp/q8/model \
  --dataset /tmp/q8/data.jsonl --samples 600 --answer-tokens 500 2900 --seed 1 2>&1 | tail -1
echo "== end to end"
( while sleep 5; do p=$(pgrep -f "dflash-drafter serve" | head -1); [ -n "$p" ] && echo "$(date +%s) $(ps -o rss= -p $p)"; done ) > "$OUT/drafter-rss.txt" 2>/dev/null &
RSS=$!
timeout 300 $B/dflash up --config deploy/configs/h200-qwen3-8b-e2e.toml --max-steps 80 --workdir /tmp/q8/up > "$OUT/e2e.log" 2>&1
echo "e2e exit $?"
kill $RSS 2>/dev/null
grep -E "step [0-9]+/" "$OUT/e2e.log" | grep -oE "step [0-9]+/80|[0-9]+ tok/s" | paste - - | tr '\n' ';'; echo
grep -iE "supply|bounds|waiting" "$OUT/e2e.log" | tail -3
awk '{print $2}' "$OUT/drafter-rss.txt" | tr '\n' ' '; echo
