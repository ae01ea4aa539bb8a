"""An independent plain-PyTorch DFlash trainer, written from the algorithm's description
alone (it shares no code with the Rust trainer), to check the Rust trainer's
learning against a second implementation on the same data.

It computes the target's features in-process (its own Llama forward over the
converted SmolLM2 directory), trains a drafter, and exports it in the served
layout, so `dflash-drafter eval` measures both trainers' drafters the same way.

    python3 scripts/reference/dflash_reference.py \
        --target .cache/models/smollm2-135m-instruct \
        --data .cache/data/chitchat-smollm2-600.jsonl --out runs/reference \
        --minutes 15 --threads 2

Needs torch, safetensors and tokenizers (CPU is enough).
"""
import argparse
import json
import math
import os
import random
import time

import torch
import torch.nn.functional as F
try:  # sweep.py brings its own reader and pre-tokenized data where these are missing
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer
except ImportError:
    load_file = save_file = Tokenizer = None

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_tables(pos, d, theta):
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    f = pos.to(torch.float64)[..., None] * inv
    emb = torch.cat([f, f], -1)
    return emb.cos().float(), emb.sin().float()


def rotate(x, cos, sin):  # x [..., T, heads, d]; cos/sin [..., T, d]
    h = x.shape[-1] // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], -1)
    return x * cos.unsqueeze(-2) + rot * sin.unsqueeze(-2)


class Target:
    """A Llama forward that stops after the last captured layer."""

    def __init__(self, d):
        self.c = json.load(open(os.path.join(d, "config.json")))
        self.w = load_file(os.path.join(d, "model.safetensors"))
        self.w = {k: v.float() for k, v in self.w.items()}
        self.embed = self.w["model.embed_tokens.weight"]
        self.head = self.w.get("lm_head.weight", self.embed)

    @torch.no_grad()
    def features(self, ids, layer_ids):
        c, w = self.c, self.w
        nh, kv = c["num_attention_heads"], c["num_key_value_heads"]
        d = c.get("head_dim", c["hidden_size"] // nh)
        eps = c["rms_norm_eps"]
        t = len(ids)
        x = self.embed[torch.tensor(ids)]
        cos, sin = rope_tables(torch.arange(t), d, c.get("rope_theta", 10000.0))
        out = []
        for i in range(max(layer_ids) + 1):
            p = f"model.layers.{i}."
            h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
            q = rotate((h @ w[p + "self_attn.q_proj.weight"].T).view(t, nh, d), cos, sin)
            k = rotate((h @ w[p + "self_attn.k_proj.weight"].T).view(t, kv, d), cos, sin)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).view(t, kv, d)
            k = k.repeat_interleave(nh // kv, 1)
            v = v.repeat_interleave(nh // kv, 1)
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
            x = x + o.transpose(0, 1).reshape(t, nh * d) @ w[p + "self_attn.o_proj.weight"].T
            h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
            g = F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)
            x = x + g @ w[p + "mlp.down_proj.weight"].T
            if i in layer_ids:
                out.append(x)
        return torch.cat(out, -1)


def encode(tok, messages):
    """ChatML ids and the assistant mask (content, <|im_end|> and its newline)."""
    if messages[0]["role"] != "system":
        messages = [{"role": "system", "content": DEFAULT_SYSTEM}] + messages
    text, spans = "", []
    for m in messages:
        head = f"<|im_start|>{m['role']}\n"
        body = f"{m['content']}<|im_end|>\n"
        if m["role"] == "assistant":
            spans.append((len(text) + len(head), len(text) + len(head) + len(body)))
        text += head + body
    enc = tok.encode(text, add_special_tokens=False)
    mask = [int(any(s <= a < e for s, e in spans)) for a, _ in enc.offsets]
    return enc.ids, mask


class Drafter(torch.nn.Module):
    def __init__(self, H, I, L, nh, kv, d, k_layers, eps, theta, init):
        super().__init__()
        self.nh, self.kv, self.d, self.eps, self.theta = nh, kv, d, eps, theta
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False)
        self.fc = lin(k_layers * H, H)
        self.hidden_norm = torch.nn.Parameter(torch.ones(H))
        self.layers = torch.nn.ModuleList()
        for _ in range(L):
            m = torch.nn.Module()
            m.q, m.k, m.v, m.o = lin(H, nh * d), lin(H, kv * d), lin(H, kv * d), lin(nh * d, H)
            m.gate, m.up, m.down = lin(H, I), lin(H, I), lin(I, H)
            m.ln1, m.ln2 = torch.nn.Parameter(torch.ones(H)), torch.nn.Parameter(torch.ones(H))
            m.qn, m.kn = torch.nn.Parameter(torch.ones(d)), torch.nn.Parameter(torch.ones(d))
            self.layers.append(m)
        self.norm = torch.nn.Parameter(torch.ones(H))
        self.dropout = 0.0  # residual-branch dropout while training (sweep.py sets it)
        if init == "hf":
            for p in self.modules():
                if isinstance(p, torch.nn.Linear):
                    torch.nn.init.normal_(p.weight, std=0.02)

    def forward(self, feats, blk, blk_pos, mask):
        """feats [n,S,kH]; blk [n,Q,H] embedded; blk_pos [n,Q]; mask [n,1,Q,S+Q]."""
        n, S, _ = feats.shape
        Q = blk.shape[1]
        nh, kv, d, eps = self.nh, self.kv, self.d, self.eps
        ctx = rms_norm(self.fc(feats), self.hidden_norm, eps)
        cc, cs = rope_tables(torch.arange(S), d, self.theta)
        bc, bs = rope_tables(blk_pos, d, self.theta)
        x = blk
        for m in self.layers:
            h = rms_norm(x, m.ln1, eps)
            q = rotate(rms_norm(m.q(h).view(n, Q, nh, d), m.qn, eps), bc, bs)
            kc = rotate(rms_norm(m.k(ctx).view(n, S, kv, d), m.kn, eps), cc, cs)
            kb = rotate(rms_norm(m.k(h).view(n, Q, kv, d), m.kn, eps), bc, bs)
            k = torch.cat([kc, kb], 1).repeat_interleave(nh // kv, 2)
            v = torch.cat([m.v(ctx).view(n, S, kv, d), m.v(h).view(n, Q, kv, d)], 1).repeat_interleave(nh // kv, 2)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
            drop = lambda t: F.dropout(t, self.dropout, self.training) if self.dropout else t
            x = x + drop(m.o(o.transpose(1, 2).reshape(n, Q, nh * d)))
            h = rms_norm(x, m.ln2, eps)
            x = x + drop(m.down(F.silu(m.gate(h)) * m.up(h)))
        return rms_norm(x, self.norm, eps)

    def state_for_export(self):
        s = {"fc.weight": self.fc.weight, "hidden_norm.weight": self.hidden_norm, "norm.weight": self.norm}
        for i, m in enumerate(self.layers):
            p = f"layers.{i}."
            s.update({
                p + "input_layernorm.weight": m.ln1, p + "post_attention_layernorm.weight": m.ln2,
                p + "self_attn.q_proj.weight": m.q.weight, p + "self_attn.k_proj.weight": m.k.weight,
                p + "self_attn.v_proj.weight": m.v.weight, p + "self_attn.o_proj.weight": m.o.weight,
                p + "self_attn.q_norm.weight": m.qn, p + "self_attn.k_norm.weight": m.kn,
                p + "mlp.gate_proj.weight": m.gate.weight, p + "mlp.up_proj.weight": m.up.weight,
                p + "mlp.down_proj.weight": m.down.weight,
            })
        return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in s.items()}


def make_batch(seqs, feats, embed, B, mask_id, gamma, n_anchors, rng):
    """Blocks of a batch of sequences, padded: inputs, mask, labels, weights."""
    chosen = []
    for ids, lm in seqs:
        cand = [i for i in range(len(ids) - 1) if lm[i] and lm[i + 1]]
        chosen.append(sorted(rng.sample(cand, min(n_anchors, len(cand)))))
    n, S = len(seqs), max(len(s[0]) for s in seqs)
    N = max(max(len(a) for a in chosen), 1)
    Q = N * B
    fx = torch.zeros(n, S, feats[0].shape[-1])
    ids_t = torch.full((n, Q), mask_id, dtype=torch.long)
    pos = torch.zeros(n, Q, dtype=torch.long)
    labels = torch.zeros(n, Q, dtype=torch.long)
    w = torch.zeros(n, Q)
    anchor_of = torch.full((n, Q), -1, dtype=torch.long)
    for i, ((ids, lm), an) in enumerate(zip(seqs, chosen)):
        fx[i, : len(ids)] = feats[i]
        for j, a in enumerate(an):
            ids_t[i, j * B] = ids[a]
            for k in range(B):
                pos[i, j * B + k] = a + k
                anchor_of[i, j * B + k] = a
                if k > 0 and a + k < len(ids):
                    labels[i, j * B + k] = ids[a + k]
                    w[i, j * B + k] = lm[a + k] * math.exp(-(k - 1) / gamma)
    qb = torch.arange(Q) // B
    ctx_ok = torch.arange(S)[None, None, :] < anchor_of[:, :, None]  # strict <
    own = (qb[:, None] == qb[None, :])[None].expand(n, Q, Q)
    mask = torch.cat([ctx_ok, own], -1)[:, None]
    return fx, embed[ids_t], pos, mask, labels, w


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--gamma", type=float, default=4.0)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--mask-id", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--init", choices=["hf", "torch"], default="hf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    t0 = time.time()
    tgt = Target(a.target)
    c = tgt.c
    n_layers = c["num_hidden_layers"]
    k = a.layers
    layer_ids = [n_layers // 2] if k == 1 else [round(1 + i * (n_layers - 4) / (k - 1)) for i in range(k)]
    tok = Tokenizer.from_file(os.path.join(a.target, "tokenizer.json"))
    data = []
    for line in open(a.data):
        line = line.strip()
        if line:
            ids, lm = encode(tok, json.loads(line)["messages"])
            ids, lm = ids[: a.max_len], lm[: a.max_len]
            if sum(lm) >= 2:
                data.append((ids, lm))
    print(f"{len(data)} sequences, {sum(len(d[0]) for d in data)} tokens, layers {layer_ids}", flush=True)
    feats = []
    for ids, _ in data:
        feats.append(tgt.features(ids, layer_ids))
    print(f"features in {time.time() - t0:.0f} s", flush=True)
    H = c["hidden_size"]
    nh = c["num_attention_heads"]
    dr = Drafter(H, c["intermediate_size"], a.layers, nh, c["num_key_value_heads"], c.get("head_dim", H // nh),
                 k, c["rms_norm_eps"], c.get("rope_theta", 10000.0), a.init)
    steps_per_epoch = math.ceil(len(data) / a.batch)
    total = a.epochs * steps_per_epoch
    if a.max_steps:
        total = min(total, a.max_steps)
    warm = math.ceil(0.04 * total)
    opt = torch.optim.AdamW(dr.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    sched = lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, total - warm)))
    embed, head = tgt.embed, tgt.head
    step, start = 0, time.time()
    deadline = start + a.minutes * 60
    while step < total and time.time() < deadline:
        order = list(range(len(data)))
        rng.shuffle(order)
        for b0 in range(0, len(order), a.batch):
            if step >= total or time.time() >= deadline:
                break
            idx = order[b0: b0 + a.batch]
            fx, blk, pos, mask, labels, w = make_batch([data[i] for i in idx], [feats[i] for i in idx], embed,
                                                    a.block_size, a.mask_id, a.gamma, a.anchors, rng)
            hid = dr(fx, blk, pos, mask)
            sel = w > 0
            logits = hid[sel] @ head.T
            ce = F.cross_entropy(logits, labels[sel], reduction="none")
            loss = (ce * w[sel]).sum() / w[sel].sum()
            for g in opt.param_groups:
                g["lr"] = a.lr * sched(step)
            opt.zero_grad()
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(dr.parameters(), 1.0)
            opt.step()
            step += 1
            if step % 25 == 0:
                with torch.no_grad():
                    ok = ((hid @ head.T).argmax(-1) == labels) & (w > 0)
                    ok = ok.view(len(idx), -1, a.block_size)[..., 1:]
                    real = w.view(len(idx), -1, a.block_size)[..., 1:].sum(-1) > 0
                    acc_len = (1 + ok.long().cumprod(-1).sum(-1).float()[real]).mean().item()
                print(f"step {step}/{total} loss {loss.item():.3f} grad {gn:.2f} sim-accept(train) {acc_len:.2f} "
                      f"elapsed {time.time() - start:.0f} s", flush=True)
    os.makedirs(a.out, exist_ok=True)
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H,
        "intermediate_size": c["intermediate_size"], "num_hidden_layers": a.layers,
        "num_attention_heads": nh, "num_key_value_heads": c["num_key_value_heads"],
        "head_dim": c.get("head_dim", H // nh), "rms_norm_eps": c["rms_norm_eps"],
        "rope_theta": c.get("rope_theta", 10000.0), "vocab_size": c["vocab_size"],
        "max_position_embeddings": c.get("max_position_embeddings", 8192), "block_size": a.block_size,
        "num_target_layers": n_layers, "torch_dtype": "bfloat16",
        "dflash_config": {"mask_token_id": a.mask_id, "target_layer_ids": layer_ids},
    }
    json.dump(cfg, open(os.path.join(a.out, "config.json"), "w"), indent=2)
    save_file(dr.state_for_export(), os.path.join(a.out, "model.safetensors"))
    print(f"trained {step} steps in {time.time() - start:.0f} s (total {time.time() - t0:.0f} s); wrote {a.out}")


if __name__ == "__main__":
    main()
