#!/usr/bin/env bash
# Final call: capture step time over 20 batches per postprocess mode, and
# the end-to-end run (drafter with cuDNN attention, as the service runs).
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
B=.device/bin
( $B/dflash-target prepare-synthetic --shape qwen3-8b --bf16 --gpu 1 --model-dir /tmp/q8/model \
  --dataset /tmp/q8/data.jsonl --samples 600 --answer-tokens 500 2900 --seed 1 > "$OUT/prepare.log" 2>&1 ) &
PREP=$!
timeout 200 $B/dflash-target bench-capture --shape qwen3-8b --device 0 --batches 20 --warmup 3 --json "$OUT/capture.json" 2>&1 | tail -4
wait $PREP
( while sleep 5; do p=$(pgrep -f "dflash-drafter serve" | head -1); [ -n "$p" ] && echo "$(date +%s) $(ps -o rss= -p $p)"; done ) > "$OUT/drafter-rss.txt" 2>/dev/null &
RSS=$!
timeout 300 $B/dflash up --config deploy/configs/h200-qwen3-8b-e2e.toml --workdir /tmp/q8/up --max-steps 50 > "$OUT/e2e.log" 2>&1
echo "e2e exit $?"; kill $RSS
grep -E "step [0-9]+/|forward busy|completed" "$OUT/e2e.log" | cut -c1-200 | tail -12
awk '{print $2}' "$OUT/drafter-rss.txt" | sort -n | sed -n '1p;$p'
