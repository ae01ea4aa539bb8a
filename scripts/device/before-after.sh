# Sourced by the before/after device scripts (after env.sh): one benchmark
# run of a build in .device/<build> (old: before a change, bin: after it).

# drafter_step <build> <anchors> <chunks> <tag> [batches] [warmup]: the
# Qwen3-8B-shaped 5-layer drafter's step on GPU 0 (12 distinct batches each
# measured once by default; 4 batches with warmup 8 = every shape warm).
drafter_step() {
  echo "== .device/$1: drafter step, $2 anchors, chunks $3, ${5:-12} batches, warmup ${6:-2}"
  timeout 240 ".device/$1/dflash-drafter" bench-step --shape qwen3-8b --device 0 --anchors "$2" --chunks "$3" \
    --context-multiple 128 --batch-tokens 12288 --batches "${5:-12}" --max-blocks 2048 --steps 12 \
    --warmup "${6:-2}" --json "$OUT/step-$4.json" 2>&1 | grep -v INFO | tail -4
}

# capture <build> <tag>: target capture with postprocess off / async / sync.
capture() {
  echo "== .device/$1: capture ($2)"
  timeout 150 ".device/$1/dflash-target" bench-capture --shape qwen3-8b --device 0 --layers 5 \
    --batches 20 --warmup 3 --json "$OUT/capture-$1-$2.json" 2>&1 | grep -v INFO | tail -4
}

# transport <build> <tag>: the hidden-state stream into pinned buffers vs raw TCP.
transport() {
  echo "== .device/$1: transport, pinned landing ($2)"
  timeout 120 ".device/$1/dflash-drafter" bench-transport --device 0 --streams 1,2,4 \
    --json "$OUT/transport-$1-$2.json" 2>&1 | grep -v INFO | tail -4
}
