#!/usr/bin/env bash
# Second 2-GPU call: capture and drafter-step benchmarks with libtorch's
# cuDNN attention off (the default now) and on, then the end-to-end run
# (target GPU 0, drafter GPU 1, Qwen3-8B shape) with a drafter SIGKILL and
# restart in the middle, timing the recovery. Results go to $OUT.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
B=.device/bin
( $B/dflash-target prepare-synthetic --shape qwen3-8b --bf16 --gpu 1 --model-dir /tmp/q8/model \
  --dataset /tmp/q8/data.jsonl --samples 600 --answer-tokens 500 2900 --seed 1 > "$OUT/prepare.log" 2>&1 ) &
PREP=$!
echo "== capture (cuDNN attention off, then on)"
timeout 120 $B/dflash-target bench-capture --shape qwen3-8b --device 0 --batches 8 --warmup 2 --json "$OUT/capture.json" 2>&1 | tail -5
timeout 90 $B/dflash-target bench-capture --shape qwen3-8b --device 0 --modes off --batches 8 --warmup 2 --cudnn-attention 2>&1 | tail -2
echo "== drafter step (4 distinct batches of up to 12288 tokens)"
for a in 256 512; do
  timeout 200 $B/dflash-drafter bench-step --shape qwen3-8b --device 0 --anchors $a --chunks 64,32 --batch-tokens 12288 \
    --batches 4 --max-blocks 2048 --steps 8 --warmup 2 --json "$OUT/step-$a.json" 2>&1 | tail -3
done
timeout 120 $B/dflash-drafter bench-step --shape qwen3-8b --device 0 --anchors 512 --chunks 100000 --batch-tokens 12288 \
  --batches 4 --max-blocks 2048 --steps 4 --warmup 1 2>&1 | tail -1
wait $PREP; tail -1 "$OUT/prepare.log"

echo "== end to end with a drafter restart"
C=deploy/configs/h200-qwen3-8b-e2e.toml
rm -rf /tmp/q8/checkpoints /tmp/q8/ledger.sqlite
$B/dflash-coordinator --config $C --listen 127.0.0.1:50051 --ledger /tmp/q8/ledger.sqlite \
  --max-steps 60 --set checkpoint.interval_steps=20 > "$OUT/coord.log" 2>&1 &
$B/dflash-target serve --coordinator http://127.0.0.1:50051 --health-listen 127.0.0.1:50061 > "$OUT/target.log" 2>&1 &
TPID=$!
$B/dflash-drafter serve --coordinator http://127.0.0.1:50051 --listen 127.0.0.1:50052 --advertise http://127.0.0.1:50052 > "$OUT/drafter1.log" 2>&1 &
D1=$!
( while sleep 5; do for p in $(pgrep -f "dflash-drafter serve"); do echo "$(date +%s) $p $(ps -o rss= -p $p)"; done; done ) > "$OUT/drafter-rss.txt" 2>/dev/null &
RSS=$!
for i in $(seq 1 240); do grep -q "step 30/" "$OUT/drafter1.log" && break; sleep 1; done
kill -9 $D1; T_KILL=$(date +%s.%N)
$B/dflash-drafter serve --coordinator http://127.0.0.1:50051 --listen 127.0.0.1:50052 --advertise http://127.0.0.1:50052 > "$OUT/drafter2.log" 2>&1 &
for i in $(seq 1 1200); do grep -q "INFO step [0-9]*/" "$OUT/drafter2.log" && break; sleep 0.1; done
T_STEP=$(date +%s.%N)
echo "drafter SIGKILL -> first trained step after restart: $(python3 -c "print(round($T_STEP - $T_KILL, 2))") s"
for i in $(seq 1 240); do kill -0 $TPID 2>/dev/null || break; sleep 1; done
kill $RSS 2>/dev/null
echo "target pid $TPID exited; same process throughout: $(grep -c 'registered target' "$OUT/coord.log") registration(s)"
grep -E "step [0-9]+/|resumed|redone|completed|replay" "$OUT/drafter1.log" "$OUT/drafter2.log" "$OUT/coord.log" "$OUT/target.log" | cut -c1-230 | tail -22
grep -E "forward busy" "$OUT/target.log" | tail -2
