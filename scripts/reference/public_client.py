"""Replays `dflash eval --json` with the DFlash authors' public client (the
`dflash` package): loads the exported drafter with its `DFlashDraftModel`,
the target with transformers, and for every prompt of the trained report
decodes with `dflash_generate` (greedy). Prints one JSON object: per prompt
whether the tokens equal ours and the acceptance length of each verify step
(`per_step`), and for the prompts eval wrote `block_logits` of, the largest
difference between the package's first-block logits and ours.

    python scripts/reference/public_client.py TARGET_DIR DRAFTER_DIR EVAL_JSON

Runs on the CPU, or on the device DFLASH_REF_DEVICE names (e.g. cuda).
"""
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM

import time

import dflash.model
from dflash.model import DFlash2DraftModel, DFlashDraftModel, dflash_generate, extract_context_feature

# return_stats times with torch.cuda.synchronize(); on a CPU-only machine
# time on the host clock instead (the timing is not compared, the decode is).
if not torch.cuda.is_available():
    dflash.model._cuda_time = time.perf_counter

target_dir, drafter_dir, eval_json = sys.argv[1:4]
torch.manual_seed(0)
ev = json.load(open(eval_json))
device = torch.device(os.environ.get("DFLASH_REF_DEVICE", "cpu"))
target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(device).eval()
architecture = json.load(open(f"{drafter_dir}/config.json"))["architectures"][0]
model_class = {"DFlashDraftModel": DFlashDraftModel, "DFlash2DraftModel": DFlash2DraftModel}[architecture]
drafter = model_class.from_pretrained(drafter_dir, dtype=torch.float32).to(device).eval()
trained = next(r for r in ev["reports"] if r["label"] == "trained")
block = drafter.block_size

# A hybrid target (linear-attention layers): going back after a rejected
# block must also restore the recurrent state, which transformers' cache
# does only when it records the per-token states (`recurrent_states_to_keep`,
# transformers >= 5.25); the package (0.1.0) asks for none, and then its
# target keeps the rejected tokens in the state. Its caches are made to
# record a block's worth.
if "linear_attention" in (getattr(target.config, "layer_types", None) or []):
    import inspect

    from transformers import DynamicCache
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    if "recurrent_states_to_keep" not in inspect.signature(LinearAttentionCacheLayerMixin.activate_past_recording).parameters:
        sys.exit("a hybrid target needs transformers >= 5.25, whose cache can restore recurrent states")

    def recording_cache(config):
        cache = DynamicCache(config=config)
        cache.activate_past_recording(recurrent_states_to_keep=block)
        return cache

    dflash.model._make_cache = recording_cache
result = {
    "architecture": architecture,
    "block_size": block,
    # What the package made of layer_types: each layer's window and causality.
    "layer_windows": [layer.self_attn.sliding_window for layer in drafter.layers],
    "layer_causal": [layer.self_attn.is_causal for layer in drafter.layers],
    "prompts": [],
    "block_logits": [],
}

# The package's proposal at each verify step: the argmax of every block's
# logits (dflash_generate takes exactly that at temperature 0), or for
# DFlash2 the selector's walk (`propose`); `selector_moved` counts the steps
# where the walk proposed other tokens than the argmax.
proposals = []
counts = {"selector_moved": 0}
compute_logits = drafter.compute_logits
if model_class is DFlash2DraftModel:
    propose = drafter.propose

    def recording_propose(hidden, anchor_ids, head, temperature):
        tokens, indices, probs = propose(hidden, anchor_ids, head, temperature)
        proposals.append(tokens[0].tolist())
        counts["selector_moved"] += int(tokens[0].tolist() != compute_logits(hidden, head).argmax(-1)[0].tolist())
        return tokens, indices, probs

    drafter.propose = recording_propose
else:
    def recording_compute_logits(hidden, head):
        logits = compute_logits(hidden, head)
        proposals.append(logits.argmax(-1)[0].tolist())
        return logits

    drafter.compute_logits = recording_compute_logits

for d in trained["decodes"]:
    ids = torch.tensor([d["prompt_ids"]], dtype=torch.long, device=device)
    proposals.clear()
    out = dflash_generate(drafter, target, ids, ev["max_new_tokens"], ev["stop_ids"], return_stats=True)
    tokens = out.output_ids[0, ids.shape[1]:].tolist()
    greedy = target.generate(ids, max_new_tokens=ev["max_new_tokens"], do_sample=False,
                             eos_token_id=ev["stop_ids"], pad_token_id=ev["stop_ids"][0])[0, ids.shape[1]:].tolist()
    result["prompts"].append({
        "id": d["id"],
        "tokens_equal": tokens == d["tokens"],
        "equals_transformers_greedy": tokens == greedy,
        "ours_per_step": d["per_step"],
        "theirs_per_step": out.acceptance_lengths,
        "ours_proposals": d["proposals"],
        "theirs_proposals": list(proposals),
        # Leading steps that drafted a whole block: once fewer tokens are
        # left than a block, the package drafts a shorter one.
        "full_block_steps": sum(
            1 for i in range(len(d["per_step"]))
            if ev["max_new_tokens"] - (1 + sum(d["per_step"][:i])) + 1 >= block
        ),
    })

with torch.no_grad():
    for d, ours in zip(trained["decodes"], ev["block_logits"]):
        ids = torch.tensor([d["prompt_ids"]], dtype=torch.long, device=device)
        o = target(ids, output_hidden_states=True)
        context = extract_context_feature(o.hidden_states, drafter.target_layer_ids)
        first = o.logits[0, -1].argmax()
        blk = torch.full((1, block), drafter.mask_token_id, dtype=torch.long, device=device)
        blk[0, 0] = first
        noise = target.get_input_embeddings()(blk)
        positions = torch.arange(ids.shape[1] + block, device=device)[None]
        hidden = drafter(target_hidden=context, noise_embedding=noise, position_ids=positions)[:, 1:, :]
        theirs = drafter.compute_logits(hidden, target.lm_head)[0].cpu()
        ours = torch.tensor(ours, dtype=torch.float32)
        result["block_logits"].append({
            "id": d["id"],
            "max_abs_diff": (theirs - ours).abs().max().item(),
            "max_abs": ours.abs().max().item(),
            "argmax_equal": bool((theirs.argmax(-1) == ours.argmax(-1)).all()),
        })

result["selector_moved"] = counts["selector_moved"]
print(json.dumps(result))
