#!/usr/bin/env bash
# Resident memory of every role over a long CPU run: `dflash up` on the
# synthetic target with epochs enough to outlast MINUTES, each role's RSS
# sampled every 10 s, then the slope of a least-squares line over the samples
# after the first quarter (warm-up: pools filling, allocator arenas growing).
# Prints a table and writes soak.json and the samples (soak.csv) to OUT.
#   scripts/soak-memory.sh [MINUTES] [OUT]   (default: 30 minutes, runs/soak)
set -u
cd "$(dirname "$0")/.."
minutes=${1:-30}
out=${2:-runs/soak}
rm -rf "$out" && mkdir -p "$out"
B=${DFLASH_BIN:-target/release}
$B/dflash prepare-synthetic --model-dir "$out/model" --dataset "$out/data.jsonl" --samples 2000 > /dev/null
cat > "$out/run.toml" <<EOF
[run]
name = "soak"
epochs = 200
max_steps = 0
log_every_steps = 100
[model]
target_path = "$out/model"
dtype = "f32"
[drafter]
num_layers = 1
block_size = 8
mask_token_id = 3
[data]
train_path = "$out/data.jsonl"
max_seq_len = 256
[training]
lr = 1e-3
anchors_per_sequence = 8
max_blocks_per_micro_batch = 256
[pipeline]
token_budget = 1024
max_batch_size = 4
[devices]
target = "cpu"
drafter = "cpu"
[checkpoint]
dir = "$out/checkpoints"
interval_steps = 200
keep_last = 2
EOF
$B/dflash up --config "$out/run.toml" --workdir "$out/up" --target-threads 1 --drafter-threads 1 \
  --progress-every-s 0 --no-final-eval > "$out/up.log" 2>&1 &
up=$!
echo "t_s,role,rss_kib" > "$out/soak.csv"
t0=$(date +%s)
while [ $(( $(date +%s) - t0 )) -lt $(( minutes * 60 )) ] && kill -0 $up 2>/dev/null; do
  for role in coordinator drafter target; do
    pid=$(pgrep -P "$up" -f "dflash-$role " | head -1)  # this run's, not another's
    [ -n "$pid" ] && echo "$(( $(date +%s) - t0 )),$role,$(ps -o rss= -p "$pid" | tr -d ' ')" >> "$out/soak.csv"
  done
  sleep 10
done
kill -INT $up 2>/dev/null; wait $up 2>/dev/null
steps=$(grep -oE "step [0-9]+/" "$out/up.log" | tail -1)
python3 - "$out" "$minutes" "$steps" <<'PY'
import csv, json, sys
out, minutes, steps = sys.argv[1], float(sys.argv[2]), sys.argv[3]
rows = list(csv.DictReader(open(f"{out}/soak.csv")))
result = {"minutes": minutes, "last_step": steps.strip(), "roles": {}}
print(f"{'role':<12} {'samples':>7} {'first MiB':>10} {'last MiB':>9} {'max MiB':>8} {'slope MiB/min (after warm-up)':>30}")
for role in ("coordinator", "drafter", "target"):
    pts = [(float(r["t_s"]), float(r["rss_kib"]) / 1024) for r in rows if r["role"] == role and r["rss_kib"]]
    if len(pts) < 8:
        continue
    tail = pts[len(pts) // 4:]
    n = len(tail)
    mt = sum(t for t, _ in tail) / n
    mr = sum(r for _, r in tail) / n
    slope = sum((t - mt) * (r - mr) for t, r in tail) / max(sum((t - mt) ** 2 for t, _ in tail), 1e-9) * 60
    result["roles"][role] = {"samples": len(pts), "first_mib": pts[0][1], "last_mib": pts[-1][1],
                             "max_mib": max(r for _, r in pts), "slope_mib_per_min": slope}
    print(f"{role:<12} {len(pts):>7} {pts[0][1]:>10.1f} {pts[-1][1]:>9.1f} {max(r for _, r in pts):>8.1f} {slope:>30.3f}")
json.dump(result, open(f"{out}/soak.json", "w"), indent=1)
print(f"run reached {steps.strip()}; samples in {out}/soak.csv")
PY
