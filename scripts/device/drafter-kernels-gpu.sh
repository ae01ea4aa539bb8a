#!/usr/bin/env bash
# One GPU (issue 40): the drafter step's NVRTC kernels of 2026-12-07 -- the
# top-k over the vocabulary as one kernel (DFlash2's selector) and the split
# attention's key/value gradients summed by one kernel (no f32 index_add_).
#   1. their CUDA tests (the models crate's test binary in
#      $DFLASH_BIN/deps/models_lib): the top-k against `topk`, the split
#      attention against the masked attention, the block convolution;
#   2. DFlash2 block 16 against DFlash, 512 anchors, the usual 12-batch shape,
#      twice, alternated (DFLASH_FUSED_OPS=on, the default);
#   3. long sequences: one sequence of 8K, 16K and 32K tokens, 512 anchors,
#      chunk 32 (the training default), with the kernels and without
#      (DFLASH_FUSED_OPS=off: the index_add_ path), alternated;
#   4. one profiled step of $PROFILE_VARIANT (default dflash2) and one profiled
#      32K step;
#   5. `layers`: the DFlash step on the usual shape and the 32K step with
#      this build against the builds in $OLD (binaries, space-separated, without the kernels
#      being measured: the fused RoPE and SwiGLU, csrc/fused_layers.cu; the
#      loss softmax, csrc/softmax_rows.cu), alternated, in $ROUNDS (default 1 2);
#   6. `softmax`: the loss softmax kernel at each row-cache size against the
#      ops it replaces, on one loss chunk (printed by its timing test).
# ANCHORS (default 512) and CHUNKS (attention chunk blocks, default 64) set the usual shape's
# anchors per batch and chunking.
#   scripts/device/drafter-kernels-gpu.sh [tests] [dflash2] [long] [profile] [layers] [softmax]
# Everything also goes to $OUT/kernels.log, so a call cut short keeps what ran.
set -u
cd "$(dirname "$0")/../.."
. scripts/device/env.sh
B=${DFLASH_BIN:-.device/bin}
exec > >(tee "$OUT/kernels.log") 2>&1
# The runs' JSON goes back as one archive (the device returns few files).
J=/tmp/kernels-json
mkdir -p $J
trap 'tar czf "$OUT/kernels-json.tgz" -C $J .' EXIT
phases=${*:-tests dflash2 long profile}
nvidia-smi --query-gpu=name --format=csv,noheader
quiet() { grep -v "^ERROR\|^WARNING\|^STAGE\|^\[W\|INFO"; }
usual=(--shape qwen3-8b --device 0 --layers 5 --anchors ${ANCHORS:-512} --attention split --chunks ${CHUNKS:-64} --context-multiple 128
  --batch-tokens 12288 --max-blocks 2048 --warmup 2 --block 16)
for phase in $phases; do
  case $phase in
  tests)
    for t in ${TESTS:-top_k_cuda::tests::the_gpu_top_k_returns_topks_values_with_their_ids \
      split_attention::tests::split_attention_on_cuda_matches_the_masked_attention \
      dflash2::tests::the_gpu_kernels_of_the_convolution_match_its_composite_form \
      fused_layers::tests::the_fused_layer_kernels_match_the_ops_on_a_gpu \
      softmax_cuda::tests::the_gpu_softmax_matches_the_ops \
      objective::tests::the_softmax_kernel_gives_the_terms_of_the_ops \
      trainer::tests::bf16_cross_entropy_on_cuda_matches_an_fp32_cross_entropy}; do
      timeout 150 $B/deps/models_lib --ignored --exact $t 2>&1 | grep -E "^test |panicked|assert|error" | head -10
    done ;;
  dflash2)
    for round in ${ROUNDS:-1 2}; do
      for v in dflash2 dflash; do
        echo "== $v block 16, round $round"
        timeout 100 $B/dflash bench-step "${usual[@]}" --batches 12 --steps ${STEPS:-10} --variant $v \
          --json "$J/usual-$v-$round.json" 2>&1 | quiet | tail -1
      done
    done ;;
  long)
    for len in ${LENS:-8192 16384 32768}; do
      for fused in on off; do
        echo "== $len tokens, chunk 32, fused ops $fused"
        DFLASH_FUSED_OPS=$fused timeout 100 $B/dflash bench-step --shape qwen3-8b --device 0 --layers 5 --block 16 \
          --anchors 512 --chunks 32 --attention split --batch-tokens $len --min-len $len --max-len $len \
          --batches 3 --steps 6 --warmup 2 --json "$J/long-$len-$fused.json" 2>&1 | quiet | tail -1
      done
    done ;;
  profile)
    pv=${PROFILE_VARIANT:-dflash2}
    echo "== $pv block 16, profiled"
    timeout 120 $B/dflash bench-step "${usual[@]}" --variant $pv --batches 2 --steps 3 --profile \
      --json "$J/profile-$pv.json" 2>&1 | quiet | tail -50
    echo "== 32K tokens, chunk 32, profiled"
    timeout 120 $B/dflash bench-step --shape qwen3-8b --device 0 --layers 5 --block 16 --anchors 512 --chunks 32 \
      --attention split --batch-tokens 32768 --min-len 32768 --max-len 32768 --batches 1 --steps 2 --warmup 2 \
      --profile --json "$J/profile-32k.json" 2>&1 | quiet | tail -50 ;;
  layers)
    old=${OLD:?OLD names the binaries to compare with}
    for round in ${ROUNDS:-1 2}; do
      for bin in $B/dflash $old; do
        echo "== dflash block 16, $bin, round $round"
        timeout 100 $bin bench-step "${usual[@]}" --batches 12 --steps ${STEPS:-10} --variant dflash \
          --json "$J/layers-usual-${ANCHORS:-512}-${CHUNKS:-64}-$(basename $bin)-$round.json" 2>&1 | quiet | tail -1
        echo "== 32K tokens, $bin, round $round"
        timeout 100 $bin bench-step --shape qwen3-8b --device 0 --layers 5 --block 16 --anchors 512 --chunks 32 \
          --attention split --batch-tokens 32768 --min-len 32768 --max-len 32768 --batches 3 --steps 6 --warmup 2 \
          --json "$J/layers-32k-$(basename $bin)-$round.json" 2>&1 | quiet | tail -1
      done
    done ;;
  softmax)
    timeout 150 $B/deps/models_lib --ignored --exact softmax_cuda::tests::the_gpu_softmax_timings --nocapture 2>&1 |
      grep -E "^test |loss softmax|panicked" ;;
  *) echo "unknown phase $phase (tests, dflash2, long, profile, layers, softmax)"; exit 2 ;;
  esac
done
exit 0
