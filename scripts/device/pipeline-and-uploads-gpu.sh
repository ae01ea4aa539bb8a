#!/usr/bin/env bash
# One GPU, one call (issues 40 and 41), for a build with the reverted pinned
# uploads and one-pass AdamW applied again (`git revert 6df47e4`); not yet run
# (no device started in the session that wrote it):
#   1. CUDA tests: the pinned one-write uploads of the step's plans, the
#      one-pass AdamW against the CPU update, the split attention, the fused
#      layers (models test binary in .device/bin/deps/models_lib);
#   2. capture of the Qwen3-8B shape, before ($OLD) and after, whole and in 2
#      pipeline parts on the one GPU (captures left on their parts' devices);
#   3. the drafter step (usual 512-anchor shape, chunk 32, and one 32K
#      sequence) with this build against $OLD, alternated ($ROUNDS rounds, default 1);
#   4. the split attention's parts with flash and with cuDNN's ragged SDPA
#      (attention_backends_probe.py, the next step for the 32K step).
# PHASES (default "tests capture layers probe") picks and orders them.
# Results go back as one archive, $OUT/results.tgz, and the log as $OUT/run.log.
#   OLD=.device/bin/dflash-before scripts/device/pipeline-and-uploads-gpu.sh
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
R=/tmp/results
mkdir -p $R
exec > >(tee "$OUT/run.log") 2>&1
trap 'cp $OUT/kernels.log $R/ 2>/dev/null; tar czf "$OUT/results.tgz" -C $R .' EXIT
OLD=${OLD:-.device/bin/dflash-before}
phase() { [[ " ${PHASES:-tests capture layers probe} " == *" $1 "* ]]; }
phase tests && TESTS="cuda::tests::slices_uploaded_to_a_gpu_arrive_intact optim::tests::fused_adamw_on_cuda_matches_the_cpu_update \
  split_attention::tests::split_attention_on_cuda_matches_the_masked_attention \
  fused_layers::tests::the_fused_layer_kernels_match_the_ops_on_a_gpu" \
  scripts/device/drafter-kernels-gpu.sh tests
bench() { # label binary extra...
  local label=$1 bin=$2; shift 2
  timeout 100 $bin bench-capture --shape qwen3-8b --device 0 --layers 5 --batches 4 --warmup 1 --modes async "$@" \
    --json "$R/capture-$label.json" > "$R/capture-$label.log" 2>&1
  echo "capture $label (exit $?): $(grep -E '^ *async' "$R/capture-$label.log" | tail -1)"
}
phase capture && for round in ${CAPTURE_ROUNDS:-1}; do
  bench before-$round $OLD
  bench after-$round .device/bin/dflash
  bench parts2-$round .device/bin/dflash --parts 2
done
mv $OUT/kernels.log $R/tests.log 2>/dev/null
phase layers && CHUNKS=32 STEPS=6 ROUNDS=${ROUNDS:-1} OLD=$OLD scripts/device/drafter-kernels-gpu.sh layers
tar xzf $OUT/kernels-json.tgz -C $R 2>/dev/null
phase probe && timeout 200 python3 scripts/device/attention_backends_probe.py $R/probe-32k.json 32768 512 2>&1 | tail -12
exit 0
