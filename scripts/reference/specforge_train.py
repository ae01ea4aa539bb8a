"""Trains a DFlash drafter with SpecForge's own model and loss (the peer
trainer, issue 21), fed by features the target captures with transformers,
on the same data and with the same settings as a `dflash up` run, and writes
it in the same export layout (config.json + model.safetensors), so that
`dflash eval` and the `dflash` package score both drafters alike.

    python scripts/reference/specforge_train.py --target TARGET_DIR \
        --like OUR_CHECKPOINT_DIR --data train.jsonl --out OUT_DIR \
        --steps 228 --lr 1e-3 --anchors 32 --gamma 4.0 --seed 0

What is the same as `dflash up`: the drafter's shape and target layers (read
from OUR_CHECKPOINT_DIR's config.json, not its weights: SpecForge starts from
its own initialisation), the conversations, the chat template and the
assistant-only loss mask (rendered prefix by prefix, as our tokenizer does),
truncation to --max-seq-len, batches of at most --token-budget tokens and
--max-batch-size sequences in a shuffled order per epoch, AdamW (no weight
decay, betas 0.9/0.999), the global gradient clip, linear warmup over
--warmup-ratio of the steps then cosine to 0, anchors per sequence and the
slot decay exp(-(k-1)/gamma). What is SpecForge's own: its anchor sampling,
noise embedding, attention mask, loss and accuracy (`OnlineDFlashModel`),
its drafter module (`DFlashDraftModel`), and the precision: f32 master weights
under bf16 autocast on a GPU (ours trains as its config says). Prints one JSON
line per logged step and a summary line at the end (wall time, GPU time).
"""
import argparse
import json
import math
import os
import random
import shutil
import time

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
from specforge.modeling.draft.dflash import DFlashDraftModel, extract_context_feature


def encode(tok, messages, max_len):
    """Token ids and the assistant-only loss mask of one conversation: each
    assistant span runs from the end of the generation prompt before it to
    the end of its rendered turn (the end-of-turn token is trained on)."""
    full = tok.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        through = tok.apply_chat_template(messages[: i + 1], tokenize=False)
        spans.append((len(before), len(through)))
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"][:max_len]
    mask = [int(any(s <= start < e for s, e in spans)) for start, _ in enc["offset_mapping"][:max_len]]
    return ids, mask


def specforge_drafter(like, attention):
    """SpecForge's `DFlashDraftModel` (f32, its own initialisation) of the
    shape a dflash export's config.json gives."""
    cfg_json = json.load(open(os.path.join(like, "config.json")))
    cfg = Qwen3Config(**{k: v for k, v in cfg_json.items() if k not in ("architectures", "auto_map", "model_type")})
    cfg._attn_implementation = attention
    return DFlashDraftModel(cfg).float()


def online_model(drafter, target, attention, **objective):
    """SpecForge's training wrapper (anchors, block inputs, mask, loss) around
    `drafter`, with the target's embeddings and LM head; `objective`:
    num_anchors, loss_decay_gamma, loss_type, dpace_alpha."""
    return OnlineDFlashModel(
        draft_model=drafter,
        target_lm_head=target.lm_head,
        target_embed_tokens=target.get_input_embeddings(),
        mask_token_id=drafter.mask_token_id,
        block_size=drafter.block_size,
        attention_backend=attention,
        **objective,
    )


def plan_epoch(lengths, rng, token_budget, max_batch_size):
    """One epoch's batches: a shuffled order cut greedily into batches of at
    most `token_budget` tokens and `max_batch_size` sequences."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    batches, cur, cur_tokens = [], [], 0
    for i in order:
        n = min(lengths[i], token_budget)
        if cur and (len(cur) >= max_batch_size or cur_tokens + n > token_budget):
            batches.append(cur)
            cur, cur_tokens = [], 0
        cur.append(i)
        cur_tokens += n
    if cur:
        batches.append(cur)
    return batches


def lr_at(step, total, peak, warmup_ratio):
    warmup = max(1, int(total * warmup_ratio))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--like", required=True, help="a dflash checkpoint whose config.json gives the drafter's shape")
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-ratio", type=float, default=0.04)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--anchors", type=int, default=32)
    p.add_argument("--gamma", type=float, default=4.0)
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--token-budget", type=int, default=4096)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    # SpecForge's attention paths over its dense DFlash mask. "eager" zeroes the
    # queries of padded blocks (rows with no key); "sdpa" does not, and gave a
    # NaN loss at step 68 on an H200. Its flex_attention path is not offered:
    # it was never run here.
    p.add_argument("--attention", default="eager", choices=["eager", "sdpa"])
    p.add_argument("--log-every", type=int, default=20)
    a = p.parse_args()

    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"

    tok = AutoTokenizer.from_pretrained(a.target)
    convs = [json.loads(line)["messages"] for line in open(a.data) if line.strip()]
    samples = [encode(tok, m, a.max_seq_len) for m in convs]
    samples = [s for s in samples if sum(s[1][1:]) > 0]

    target = AutoModelForCausalLM.from_pretrained(a.target, dtype=torch.bfloat16 if cuda else torch.float32)
    target = target.to(dev).eval().requires_grad_(False)

    drafter = specforge_drafter(a.like, a.attention).to(dev)
    layer_ids = drafter.target_layer_ids
    model = online_model(drafter, target, a.attention, num_anchors=a.anchors, loss_decay_gamma=a.gamma)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)

    lengths = [len(s[0]) for s in samples]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    step, epoch, tokens_seen = 0, 0, 0
    gpu_ms = 0.0
    skipped, bad_in_a_row = 0, 0
    start = time.time()
    while step < a.steps:
        for batch in plan_epoch(lengths, rng, a.token_budget, a.max_batch_size):
            if step >= a.steps:
                break
            width = max(lengths[i] for i in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.float32)
            for r, i in enumerate(batch):
                ids[r, : lengths[i]] = torch.tensor(samples[i][0])
                mask[r, : lengths[i]] = torch.tensor(samples[i][1], dtype=torch.float32)
            ids, mask = ids.to(dev), mask.to(dev)
            attention = (torch.arange(width)[None, :] < torch.tensor([lengths[i] for i in batch])[:, None]).long()
            if cuda:
                t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0.record()
            with torch.no_grad():
                out = target(input_ids=ids, attention_mask=attention.to(dev), output_hidden_states=True)
                features = extract_context_feature(out.hidden_states, layer_ids).float()
            for g in opt.param_groups:
                g["lr"] = lr_at(step, a.steps, a.lr, a.warmup_ratio)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                loss, acc, _ = model(input_ids=ids, hidden_states=features, loss_mask=mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(params, a.grad_clip if a.grad_clip > 0 else float("inf"))
            # As our trainer does: a batch whose loss or gradient is not
            # finite is reported and not trained on; five in a row end the run.
            if not (torch.isfinite(loss) and torch.isfinite(norm)):
                skipped += 1
                bad_in_a_row += 1
                print(json.dumps({"skipped_batch": step + 1, "loss": loss.item(), "grad_norm": norm.item()}), flush=True)
                if bad_in_a_row >= 5:
                    raise SystemExit(f"five non-finite batches in a row at step {step + 1}")
                continue
            bad_in_a_row = 0
            opt.step()
            if cuda:
                t1.record()
                torch.cuda.synchronize()
                gpu_ms += t0.elapsed_time(t1)
            step += 1
            tokens_seen += int(sum(lengths[i] for i in batch))
            if step % a.log_every == 0 or step == a.steps:
                print(json.dumps({"step": step, "epoch": epoch, "loss": round(loss.item(), 4),
                                  "acc": round(acc.item(), 4), "lr": opt.param_groups[0]["lr"]}), flush=True)
        epoch += 1
    wall = time.time() - start

    os.makedirs(a.out, exist_ok=True)
    shutil.copy(os.path.join(a.like, "config.json"), os.path.join(a.out, "config.json"))
    state = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(state, os.path.join(a.out, "model.safetensors"), metadata={"format": "pt"})
    print(json.dumps({"summary": True, "steps": step, "epochs_started": epoch, "samples": len(samples),
                      "tokens": tokens_seen, "skipped_batches": skipped, "wall_s": round(wall, 2), "gpu_s": round(gpu_ms / 1000, 2)}))


if __name__ == "__main__":
    main()
