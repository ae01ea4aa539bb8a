#!/usr/bin/env bash
# On one H200, with the Qwen3-8B-shaped target and the 5-layer drafter at 512
# anchors sharing the GPU (devices.share_gpus):
# 1. the throughput cost of training in the plan's order: the same run with
#    pipeline.reorder_window = 8 (the default) and 0 (arrival order),
#    alternating, the drafter's trained tokens/s per 5-step window;
# 2. recovery: a run that SIGKILLs the drafter after its first committed
#    checkpoint and later the target (dflash up starts each again), timed from
#    the kill to the replacement's first trained step (drafter) and to the
#    first step after the replacement target loaded (target).
# The binaries arrive gzipped in .device/pack/bins.tar.gz (the carry limit);
# results go to $OUT.
#   scripts/device/order-cost-1gpu.sh [ROUNDS] [STEPS]   (default: 2 rounds of 20 steps)
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
rounds=${1:-2}
steps=${2:-20}
B=/tmp/b
mkdir -p $B && tar -xzf .device/pack/bins.tar.gz -C $B
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc
rm -rf /tmp/q8
t0=$(date +%s)
$B/dflash prepare-synthetic --shape qwen3-8b --bf16 --gpu 0 --model-dir /tmp/q8/model \
  --dataset /tmp/q8/data.jsonl --samples 400 --answer-tokens 500 2900 --seed 1 2>&1 | tail -1
echo "prepared in $(( $(date +%s) - t0 )) s"
shared="--set devices.drafter=\"0\" --set devices.share_gpus=true"
for round in $(seq "$rounds"); do
  for w in 8 0; do
    rm -rf /tmp/q8/up /tmp/q8/checkpoints
    s=$(date +%s)
    timeout 150 $B/dflash up --config deploy/configs/h200-qwen3-8b-e2e.toml --workdir /tmp/q8/up --no-final-eval \
      --max-steps "$steps" --progress-every-s 0 $shared \
      --set pipeline.reorder_window=$w > "$OUT/order-$w-$round.log" 2>&1
    echo "round $round, reorder window $w: exit $? in $(( $(date +%s) - s )) s; tok/s per 5-step window:" \
      "$(grep -oE "step [0-9]+/$steps .*[0-9]+ tok/s" "$OUT/order-$w-$round.log" | grep -oE "[0-9]+ tok/s" | tr '\n' ' ')"
  done
done
elapsed=$(( $(date +%s) - t0 ))
if [ "$elapsed" -gt 400 ]; then echo "skipping recovery: $elapsed s used"; exit 0; fi

# Waits (at most $2 s) for the log to show $1 after line $3.
wait_log() { local end=$(( $(date +%s) + $2 )); while [ "$(date +%s)" -lt $end ]; do
  tail -n +"${3:-1}" "$OUT/recovery.log" | grep -q -- "$1" && return 0; sleep 0.2; done; return 1; }
rm -rf /tmp/q8/up /tmp/q8/checkpoints
$B/dflash up --config deploy/configs/h200-qwen3-8b-e2e.toml --workdir /tmp/q8/up --no-final-eval \
  --max-steps 30 --progress-every-s 0 $shared --set checkpoint.interval_steps=8 --set run.log_every_steps=1 \
  > "$OUT/recovery.log" 2>&1 &
up=$!
if wait_log "checkpoint at step 8 committed" 150 && wait_log "step 10/" 60; then
  date +%s.%N > "$OUT/kill-drafter.t"; pkill -9 -x dflash-drafter
  n=$(wc -l < "$OUT/recovery.log")
  if wait_log "INFO step 1[0-9]/" 150 "$n" && wait_log "step 20/" 60; then
    date +%s.%N > "$OUT/kill-target.t"; pkill -9 -x dflash-target
  fi
fi
timeout 200 tail --pid=$up -f /dev/null; wait $up; echo "recovery run: exit $?"
python3 scripts/device/recovery_times.py "$OUT/recovery.log" "$OUT"
