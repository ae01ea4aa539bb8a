# Sourced by the SmolLM2 device scripts: scores a drafter in f32 on the GPU
# on the held-out prompt sets every SmolLM2 row of BENCHMARKS.md uses,
# 64 new tokens each, writing $OUT/eval-LABEL-SET.json.
#   smollm2_eval DRAFTER_DIR LABEL SET...
# SET: chat (chitchat prompts 600-619, never trained on), mt (MT-Bench turn 1,
# two per category), code (20 of the held-out `prepare-code-prompts` file),
# instr (the held-out `prepare-instruction-prompts` file: tasks never trained on).
# Needs $B (the binaries' folder), .device/g and /tmp/g/model.
smollm2_eval() {
  local drafter=$1 label=$2 set args
  shift 2
  for set in "$@"; do
    case $set in
      chat) args=(--prompts .device/g/chitchat-prompts.jsonl --offset 600 --limit 20 --set-name "held-out chitchat") ;;
      mt) args=(--prompts .device/g/mt-bench-turn1.jsonl --per-category 2 --limit 16 --set-name MT-Bench) ;;
      code) args=(--prompts .device/g/code-prompts-heldout.jsonl --limit 20 --set-name "held-out code") ;;
      instr) args=(--prompts .device/g/instruction-prompts-heldout.jsonl --set-name "held-out instructions") ;;
      *) echo "smollm2_eval: unknown prompt set '$set' (chat, mt, code or instr)" >&2; return 2 ;;
    esac
    timeout 120 "$B/dflash" eval --device 0 --dtype f32 --target /tmp/g/model --drafter "$drafter" "${args[@]}" \
      --max-new-tokens 64 --json "$OUT/eval-$label-$set.json" 2>&1 | grep -E "trained +tau" | sed "s/^/$label $set: /"
  done
}
