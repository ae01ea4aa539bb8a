"""SpecForge's DFlash objective on one batch: the loss, accuracy and gradient
norm that specforge 0.2.0's own `OnlineDFlashModel` computes for a drafter's
weights on every conversation of a dataset at once, in f32 on the CPU. The
suite compares them with the first step `dflash up` logs from the same
weights on the same data (tests/tests/peer_trainer.rs), so that the
training objective itself -- anchors, block inputs, attention mask, labels,
slot weights, normalisation and backward -- is checked against the peer
trainer's code, not only against our own second implementation.

    python3 scripts/reference/specforge_loss.py TARGET_DIR DRAFTER_DIR DATA.jsonl \
        --max-seq-len 256 --gamma 4.0

`--loss dpace` is SpecForge's D-PACE, which it divides by the batch's
sequence count where ours divides by its supervised slots (the JSON names
both counts). DRAFTER_DIR is a `dflash` export (config.json + model.safetensors). Every
position whose token and next token are both trained on is an anchor (the
anchor count is unbounded), which is what our trainer samples when
`training.anchors_per_sequence` is at least that many: no randomness is left
on either side. Prints one JSON object.
"""
import argparse
import json
import os
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from specforge.modeling.draft.dflash import extract_context_feature

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The same chat rendering and loss mask, drafter and training wrapper.
from specforge_train import encode, online_model, specforge_drafter  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target")
    p.add_argument("drafter")
    p.add_argument("data")
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--gamma", type=float, default=None, help="slot decay (unset: SpecForge's default, none)")
    p.add_argument("--loss", default="dflash", help="SpecForge's loss_type: dflash (cross-entropy) or dpace")
    p.add_argument("--dpace-alpha", type=float, default=0.5)
    a = p.parse_args()
    torch.manual_seed(0)

    tok = AutoTokenizer.from_pretrained(a.target)
    convs = [json.loads(line)["messages"] for line in open(a.data) if line.strip()]
    samples = [encode(tok, m, a.max_seq_len) for m in convs]
    samples = [s for s in samples if sum(s[1][1:]) > 0]
    target = AutoModelForCausalLM.from_pretrained(a.target, dtype=torch.float32).eval().requires_grad_(False)

    # SpecForge's eager attention path, as specforge_train.py uses it.
    drafter = specforge_drafter(a.drafter, "eager")
    state = {k: v.float() for k, v in load_file(os.path.join(a.drafter, "model.safetensors")).items()}
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        sys.exit(f"{a.drafter}: the export does not fit SpecForge's DFlashDraftModel: missing {missing}, unexpected {unexpected}")
    model = online_model(
        drafter, target, "eager", num_anchors=1 << 30, loss_decay_gamma=a.gamma, loss_type=a.loss, dpace_alpha=a.dpace_alpha
    )

    width = max(len(s[0]) for s in samples)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.full((len(samples), width), pad, dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.float32)
    attention = torch.zeros((len(samples), width), dtype=torch.long)
    for r, (t, m) in enumerate(samples):
        ids[r, : len(t)] = torch.tensor(t)
        mask[r, : len(t)] = torch.tensor(m, dtype=torch.float32)
        attention[r, : len(t)] = 1
    with torch.no_grad():
        out = target(input_ids=ids, attention_mask=attention, output_hidden_states=True)
        features = extract_context_feature(out.hidden_states, drafter.target_layer_ids).float()
    loss, acc, metrics = model(input_ids=ids, hidden_states=features, loss_mask=mask)
    loss.backward()
    params = [p for p in drafter.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, float("inf"))
    print(json.dumps({
        "samples": len(samples),
        "tokens": int(sum(len(s[0]) for s in samples)),
        "supervised_slots": int(metrics["accuracy_denom"].item()),
        "loss": loss.item(),
        "acc": acc.item(),
        "grad_norm": grad_norm.item(),
    }))


if __name__ == "__main__":
    main()
