#!/usr/bin/env bash
# Scaling of a CPU drafter group: the same synthetic run with 1, 2 and 3
# dflash-drafter processes (one libtorch thread each) and two targets, on
# loopback. Prints trained tokens/s of the group (rank 0's log lines after
# its first 10 steps) and per member, and writes JSON.
#   scripts/group-scaling-cpu.sh [STEPS] [OUT.json]
# DFLASH_BIN names prebuilt binaries (then nothing is built: the device
# machines have no Rust toolchain); MEMBERS the group sizes (default "1 2 3").
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
steps=${1:-120}
out=${2:-$root/runs/group-scaling-cpu.json}
bin=${DFLASH_BIN:-$root/target/release}
[ -n "${DFLASH_BIN:-}" ] || make -C "$root" build >/dev/null
cd "$root"
[ -f .cache/models/synthetic-llama/config.json ] ||
  "$bin/dflash" prepare-synthetic --model-dir .cache/models/synthetic-llama --dataset .cache/data/synthetic-chat.jsonl
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
echo "members | group tokens/s | per member | efficiency"
results=()
base=""
for n in ${MEMBERS:-1 2 3}; do
  dir=$work/n$n; mkdir -p "$dir"
  port=$(free_port)
  "$bin/dflash-coordinator" --config "$root/deploy/configs/cpu-synthetic.toml" \
    --set run.max_steps="$steps" --set run.epochs=20 --set group.size="$n" --set run.log_every_steps=10 \
    --set checkpoint.dir="$dir/checkpoints" --set checkpoint.interval_steps=1000 \
    --listen "127.0.0.1:$port" --ledger "$dir/ledger.sqlite" > "$dir/coordinator.log" 2>&1 &
  coord=$!
  sleep 2
  for i in $(seq 1 "$n"); do
    p=$(free_port)
    "$bin/dflash-drafter" serve --coordinator "http://127.0.0.1:$port" --listen "127.0.0.1:$p" \
      --advertise "http://127.0.0.1:$p" --threads 1 > "$dir/drafter-$i.log" 2>&1 &
  done
  for t in 0 1; do
    "$bin/dflash-target" serve --coordinator "http://127.0.0.1:$port" --instance-id "target-$t" \
      --health-listen 127.0.0.1:0 --threads 1 > "$dir/target-$t.log" 2>&1 &
  done
  wait $coord || true
  sleep 3
  leader=$(grep -l "rank 0 of world $n" "$dir"/drafter-*.log | head -1)
  # Mean of the tok/s of the log lines after the first ten steps.
  rate=$(grep -o "step [0-9]*/[0-9]* .* [0-9]* tok/s" "$leader" | awk '{split($2,a,"/"); if (a[1] > 10) {for (i=1;i<=NF;i++) if ($(i+1)=="tok/s") {s+=$i; c++}}} END {if (c) printf "%.0f", s/c; else print 0}')
  [ -n "$base" ] || base=$rate
  per=$((rate / n))
  eff=$(python3 -c "print(f'{$per / $base:.2f}')")
  echo "$n | $rate | $per | $eff"
  results+=("{\"members\": $n, \"group_tokens_per_s\": $rate, \"per_member\": $per, \"efficiency\": $eff}")
  wait || true
done
mkdir -p "$(dirname "$out")"
(IFS=,; echo "[${results[*]}]") > "$out"
echo "wrote $out"
