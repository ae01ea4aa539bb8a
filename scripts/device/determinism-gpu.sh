#!/usr/bin/env bash
# Deterministic replay on one H200 (issue 18), with the Qwen3-8B-shaped
# target and a 1-layer drafter at 512 anchors sharing the GPU (one layer:
# the checkpoints of the 5-layer drafter take 51 s each to write here):
# 1. two uninterrupted runs of STEPS steps with the default kernels (a, b)
#    and two with training.deterministic_kernels (d1, d2): are their final
#    checkpoints bit-identical? (if not: how many tensors differ, by how
#    much); the ops without a deterministic kernel, as libtorch names them;
# 2. a deterministic run with the drafter SIGKILLed after its first committed
#    checkpoint and the target SIGKILLed later (dflash up starts each again):
#    its final checkpoint against d1's, and the time from each kill to the
#    next trained step.
# The binaries arrive in .device/pack.tar.gz; results go to $OUT.
#   [RUNS="d1 d2"] scripts/device/determinism-gpu.sh [STEPS]   (default 16 steps, runs a b d1 d2)
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
steps=${1:-16}
B=.device/bin
tar -xzf .device/pack.tar.gz -C .device
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc
rm -rf /tmp/q8
t0=$(date +%s)
$B/dflash prepare-synthetic --shape qwen3-8b --bf16 --gpu 0 --model-dir /tmp/q8/model \
  --dataset /tmp/q8/data.jsonl --samples 400 --answer-tokens 500 2900 --seed 1 2>&1 | tail -1
echo "prepared in $(( $(date +%s) - t0 )) s"
common=(--config deploy/configs/h200-qwen3-8b-e2e.toml --no-final-eval --max-steps "$steps" --progress-every-s 0
  --set 'devices.drafter="0"' --set devices.share_gpus=true --set drafter.num_layers=1
  --set checkpoint.keep_last=2 --set run.log_every_steps=1)

for name in ${RUNS:-a b d1 d2}; do
  rm -rf /tmp/q8/up
  det=false; case $name in d*) det=true;; esac
  s=$(date +%s)
  timeout 150 $B/dflash up "${common[@]}" --workdir /tmp/q8/up --set "checkpoint.dir=\"/tmp/q8/ck-$name\"" \
    --set checkpoint.interval_steps=1000 --set training.deterministic_kernels=$det > "$OUT/run-$name.log" 2>&1
  echo "run $name (deterministic kernels $det): exit $? in $(( $(date +%s) - s )) s;" \
    "tok/s: $(grep -oE "INFO step [0-9]+/$steps .* [0-9]+ tok/s" "$OUT/run-$name.log" | grep -oE "[0-9]+ tok/s" | tr '\n' ' ')"
done
echo "ops without a deterministic kernel (d1):"
grep -iE "deterministic" "$OUT/run-d1.log" | grep -v "deterministic kernels only" | sed -E 's/.*(Warning|WARN)//' | sort | uniq -c | head -20

# Waits (at most $2 s) for the log to show $1 after line $3.
wait_log() { local end=$(( $(date +%s) + $2 )); while [ "$(date +%s)" -lt $end ]; do
  tail -n +"${3:-1}" "$OUT/run-c.log" | grep -q -- "$1" && return 0; sleep 0.2; done; return 1; }
rm -rf /tmp/q8/up
$B/dflash up "${common[@]}" --workdir /tmp/q8/up --set 'checkpoint.dir="/tmp/q8/ck-c"' \
  --set checkpoint.interval_steps=6 --set training.deterministic_kernels=true > "$OUT/run-c.log" 2>&1 &
up=$!
if wait_log "checkpoint at step 6 committed" 150 && wait_log "step 8/" 60; then
  date +%s.%N > "$OUT/kill-drafter.t"; pkill -9 -x dflash-drafter
  n=$(wc -l < "$OUT/run-c.log")
  if wait_log "INFO step [0-9]*/" 150 "$n" && wait_log "step 12/" 60; then
    date +%s.%N > "$OUT/kill-target.t"; pkill -9 -x dflash-target
  fi
fi
timeout 240 tail --pid=$up -f /dev/null; wait $up; echo "run c (killed and resumed): exit $?"

python3 - "$OUT" <<'PY'
import datetime, glob, hashlib, json, os, re, struct, sys
import torch
out = sys.argv[1]

def final(name):
    dirs = sorted(glob.glob(f"/tmp/q8/ck-{name}/step-*"), key=lambda d: int(d.rsplit("-", 1)[1]))
    return dirs[-1] if dirs else None

def tensors(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    kinds = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        out[k] = torch.frombuffer(bytearray(raw[8 + n + a:8 + n + b]), dtype=kinds[v["dtype"]]).reshape(v["shape"])
    return raw, out

def compare(base, other):
    ref = final(base)
    ra, ta = tensors(f"{ref}/model.safetensors")
    d = final(other)
    if not d or os.path.basename(d) != os.path.basename(ref):
        print(f"{other}: no final checkpoint at {os.path.basename(ref)} ({d})"); return
    rb, tb = tensors(f"{d}/model.safetensors")
    same = hashlib.sha256(rb).digest() == hashlib.sha256(ra).digest()
    diff = {k: (ta[k].double() - tb[k].double()).abs().max().item() for k in ta if not torch.equal(ta[k], tb[k])}
    worst = sorted(diff.items(), key=lambda kv: -kv[1])[:5]
    scale = max(ta[k].double().abs().max().item() for k in ta)
    print(f"{other} vs {base} ({os.path.basename(ref)}): {'bit-identical' if same else 'differs'};"
          f" {len(diff)} of {len(ta)} tensors differ; largest |diff| {worst[0][1] if worst else 0:.3e}"
          f" (largest |weight| {scale:.3e}); worst: {worst[:3]}")

print("final checkpoints:", {k: final(k) for k in ("a", "b", "d1", "d2", "c")})
for base, other in (("a", "b"), ("d1", "d2"), ("d1", "c"), ("a", "d1")):
    try:
        compare(base, other)
    except Exception as e:
        print(f"{other} vs {base}: {e}")

PY
python3 scripts/device/recovery_times.py "$OUT/run-c.log" "$OUT"
