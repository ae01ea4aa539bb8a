"""Sweeps training settings of the independent PyTorch DFlash trainer
(dflash_reference.py) on a GPU, scoring each drafter by its held-out simulated
acceptance (every anchor of held-out greedy outputs), to find what moves
learning on SmolLM2 + 600 chitchat conversations before spending CPU runs.

Inputs are pre-tokenized (ids + assistant mask per line, written by
`tokenize.py`), so the machine needs only torch.

    python3 scripts/reference/sweep.py --target MODEL_DIR --train train.tok.jsonl \
        --heldout heldout.tok.jsonl --out results.json --configs base,lr3e-3 --jobs 8
"""
import argparse
import json
import math
import os
import random
import struct
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))


def load_safetensors(path):
    """A tiny safetensors reader (the device machine lacks the package)."""
    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        s, e = meta["data_offsets"]
        t = torch.frombuffer(bytearray(raw[base + s:base + e]), dtype=dtypes[meta["dtype"]])
        out[name] = t.view(meta["shape"])
    return out


# Sweep points: name -> overrides of BASE.
BASE = dict(layers=2, layer_ids=None, batch=2, lr=2e-3, steps=1100, wd=0.0, noise=0.0, init="hf",
            anchors=32, block=8, gamma=4.0, mask_id=3, loss="assistant", seed=0, warmup=0.04,
            dropout=0.0, ema=0.0)
CONFIGS = {
    "base": {},
    "seed1": dict(seed=1),
    "lr1e-3": dict(lr=1e-3),
    "lr3e-3": dict(lr=3e-3),
    "b1": dict(batch=1, steps=2200),
    "b4": dict(batch=4, steps=550),
    "b8_6e-4": dict(batch=8, steps=450, lr=6e-4),
    "b8_2e-3": dict(batch=8, steps=450, lr=2e-3),
    "noise0.05": dict(noise=0.05),
    "noise0.5": dict(noise=0.5),
    "wd0.1": dict(wd=0.1),
    "ids27": dict(layer_ids=[27]),
    "ids14_27": dict(layer_ids=[14, 27]),
    "ids20_27": dict(layer_ids=[20, 27]),
    "ids24": dict(layer_ids=[24]),
    "ids5": dict(layer_ids=[1, 7, 14, 20, 27]),
    "torchinit": dict(init="torch"),
    "inittarget": dict(init="target"),
    "inittarget_low": dict(init="target_low"),
    "noise2": dict(noise=2.0),
    "steps4400": dict(steps=4400),
    # Round 2: the large-batch, low-lr regime at budgets two CPU cores allow.
    "b8_6e-4_300": dict(batch=8, steps=300, lr=6e-4),
    "b8_1e-3_300": dict(batch=8, steps=300, lr=1e-3),
    "b8_1e-3_450": dict(batch=8, steps=450, lr=1e-3),
    "b8_4e-4_450": dict(batch=8, steps=450, lr=4e-4),
    "b8_6e-4_450_it": dict(batch=8, steps=450, lr=6e-4, init="target"),
    "b4_6e-4_600": dict(batch=4, steps=600, lr=6e-4),
    "b4_6e-4_900": dict(batch=4, steps=900, lr=6e-4),
    "b4_1e-3_900": dict(batch=4, steps=900, lr=1e-3),
    "b16_1e-3_225": dict(batch=16, steps=225, lr=1e-3),
    "b16_6e-4_225": dict(batch=16, steps=225, lr=6e-4),
    "b2_6e-4_1100": dict(batch=2, steps=1100, lr=6e-4),
    "b2_6e-4_1800": dict(batch=2, steps=1800, lr=6e-4),
    "b8_6e-4_600": dict(batch=8, steps=600, lr=6e-4),
    "b8_6e-4_450_s1": dict(batch=8, steps=450, lr=6e-4, seed=1),
    "b8_6e-4_450_wd": dict(batch=8, steps=450, lr=6e-4, wd=0.1),
    "b8_6e-4_450_ids14": dict(batch=8, steps=450, lr=6e-4, layer_ids=[14, 27]),
    # Round 3: regularisers against memorising 600 conversations, at run 11's settings.
    "r11": dict(batch=4, steps=900, lr=6e-4),
    "r11_s1": dict(batch=4, steps=900, lr=6e-4, seed=1),
    "r11_s2": dict(batch=4, steps=900, lr=6e-4, seed=2),
    "r11_do0.1": dict(batch=4, steps=900, lr=6e-4, dropout=0.1),
    "r11_do0.2": dict(batch=4, steps=900, lr=6e-4, dropout=0.2),
    "r11_do0.1_lr1e-3": dict(batch=4, steps=900, lr=1e-3, dropout=0.1),
    "r11_ema0.99": dict(batch=4, steps=900, lr=6e-4, ema=0.99),
    "r11_ema0.995_lr1e-3": dict(batch=4, steps=900, lr=1e-3, ema=0.995),
    "r11_do0.1_12ep": dict(batch=4, steps=1800, lr=6e-4, dropout=0.1),
    "r11_do0.2_12ep": dict(batch=4, steps=1800, lr=6e-4, dropout=0.2),
    "lossall": dict(loss="all"),
    "steps600": dict(steps=600),
    "steps2200": dict(steps=2200),
}


def default_ids(n, k):
    return [n // 2] if k == 1 else [round(1 + i * (n - 4) / (k - 1)) for i in range(k)]


def blocks(ids, lm, anchors, B, mask_id, gamma, S):
    """Block tensors of one sequence at the given anchors (lists)."""
    N = len(anchors)
    Q = N * B
    a = torch.tensor(anchors).repeat_interleave(B)
    k = torch.arange(B).repeat(N)
    pos = a + k
    ids_t = torch.full((Q,), mask_id, dtype=torch.long)
    ids_t[k == 0] = torch.tensor(ids)[torch.tensor(anchors)]
    idt = torch.tensor(ids + [0] * B)
    lmt = torch.tensor(lm + [0] * B, dtype=torch.float32)
    labels = idt[pos]
    w = (k > 0).float() * (pos < len(ids)).float() * lmt[pos] * torch.exp(-(k - 1).clamp(min=0).float() / gamma)
    ctx_ok = torch.arange(S)[None, :] < a[:, None]
    qb = torch.arange(Q) // B
    own = qb[:, None] == qb[None, :]
    return ids_t, pos, labels, w, torch.cat([ctx_ok, own], -1)


def batch_of(seqs, feats, cfg, rng, all_anchors=False):
    B = cfg["block"]
    chosen = []
    for ids, lm in seqs:
        cand = [i for i in range(len(ids) - 1) if lm[i] and lm[i + 1]]
        chosen.append(sorted(cand) if all_anchors else sorted(rng.sample(cand, min(cfg["anchors"], len(cand)))))
    n, S = len(seqs), max(len(s[0]) for s in seqs)
    N = max(max(len(a) for a in chosen), 1)
    Q = N * B
    dev = feats[0].device
    fx = torch.zeros(n, S, feats[0].shape[-1], device=dev)
    ids_t = torch.full((n, Q), cfg["mask_id"], dtype=torch.long)
    pos = torch.zeros(n, Q, dtype=torch.long)
    labels = torch.zeros(n, Q, dtype=torch.long)
    w = torch.zeros(n, Q)
    mask = torch.zeros(n, Q, S + Q, dtype=torch.bool)
    for i, ((ids, lm), an) in enumerate(zip(seqs, chosen)):
        fx[i, :len(ids)] = feats[i]
        if not an:
            continue
        q = len(an) * B
        it, p, lb, ww, m = blocks(ids, lm, an, B, cfg["mask_id"], cfg["gamma"], S)
        ids_t[i, :q], pos[i, :q], labels[i, :q], w[i, :q] = it, p, lb, ww
        mask[i, :q, :S] = m[:, :S]
        mask[i, :q, S:S + q] = m[:, S:]
    # Padding queries see their own slot only (keeps softmax finite).
    diag = torch.eye(Q, dtype=torch.bool)[None].expand(n, Q, Q)
    mask[:, :, S:] |= diag
    return (fx, ids_t.to(dev), pos.to(dev), mask[:, None].to(dev), labels.to(dev), w.to(dev))


def sim_accept(hid, head, labels, w, B):
    ok = ((hid @ head.T).argmax(-1) == labels) & (w > 0)
    ok = ok.view(ok.shape[0], -1, B)[..., 1:]
    real = w.view(w.shape[0], -1, B)[..., 1:].sum(-1) > 0
    return (1 + ok.long().cumprod(-1).sum(-1).float())[real]


def run(cfg, target_dir, train, held, dev):
    from dflash_reference import Drafter, Target, rope_tables  # noqa: F401

    import dflash_reference
    dflash_reference.load_file = load_safetensors
    torch.manual_seed(cfg["seed"])
    rng = random.Random(cfg["seed"])
    tgt = Target(target_dir)
    tgt.w = {k: v.to(dev) for k, v in tgt.w.items()}
    tgt.embed = tgt.w["model.embed_tokens.weight"]
    tgt.head = tgt.w.get("lm_head.weight", tgt.embed)
    c = tgt.c
    n_layers = c["num_hidden_layers"]
    ids_l = cfg["layer_ids"] or default_ids(n_layers, cfg["layers"])
    # The reference code builds its index tensors without a device: make
    # every new tensor live on the GPU.
    torch.set_default_device(dev)
    tf = [tgt.features(ids, ids_l) for ids, _ in train]
    hf = [tgt.features(ids, ids_l) for ids, _ in held]
    H, nh = c["hidden_size"], c["num_attention_heads"]
    d = c.get("head_dim", H // nh)
    init = "torch" if cfg["init"] == "torch" else "hf"
    dr = Drafter(H, c["intermediate_size"], cfg["layers"], nh, c["num_key_value_heads"], d, len(ids_l),
                 c["rms_norm_eps"], c.get("rope_theta", 10000.0), init).to(dev)
    if cfg["init"].startswith("target"):
        # The drafter's layers start as the target's last (or first) layers.
        w = tgt.w
        first = 0 if cfg["init"] == "target_low" else n_layers - cfg["layers"]
        for j, m in enumerate(dr.layers):
            p = f"model.layers.{first + j}."
            with torch.no_grad():
                for mine, theirs in [(m.q, "self_attn.q_proj"), (m.k, "self_attn.k_proj"), (m.v, "self_attn.v_proj"),
                                     (m.o, "self_attn.o_proj"), (m.gate, "mlp.gate_proj"), (m.up, "mlp.up_proj"),
                                     (m.down, "mlp.down_proj")]:
                    mine.weight.copy_(w[p + theirs + ".weight"])
                m.ln1.copy_(w[p + "input_layernorm.weight"])
                m.ln2.copy_(w[p + "post_attention_layernorm.weight"])
    dr.dropout = cfg["dropout"]
    ema = None
    if cfg["ema"]:
        ema = {k: v.detach().clone() for k, v in dr.state_dict().items()}
    if cfg["loss"] == "all":
        # Loss on every token after the system turn (user turns too).
        train = [(ids, [1 if i >= first_user(ids) else 0 for i in range(len(ids))]) for ids, _ in train]
    total = cfg["steps"]
    warm = math.ceil(cfg["warmup"] * total)
    opt = torch.optim.AdamW(dr.parameters(), lr=cfg["lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=cfg["wd"])
    sched = lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, total - warm)))
    head = tgt.head
    B = cfg["block"]
    step, t0, curve = 0, time.time(), []
    while step < total:
        order = list(range(len(train)))
        rng.shuffle(order)
        for b0 in range(0, len(order), cfg["batch"]):
            if step >= total:
                break
            idx = order[b0:b0 + cfg["batch"]]
            fx, ids_t, pos, mask, labels, w = batch_of([train[i] for i in idx], [tf[i] for i in idx], cfg, rng)
            if cfg["noise"] > 0:
                fx = fx + (torch.rand_like(fx) - 0.5) * (cfg["noise"] * math.sqrt(12.0))
            hid = dr(fx, head[ids_t], pos, mask)
            sel = w > 0
            ce = F.cross_entropy(hid[sel] @ head.T, labels[sel], reduction="none")
            loss = (ce * w[sel]).sum() / w[sel].sum()
            for g in opt.param_groups:
                g["lr"] = cfg["lr"] * sched(step)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(dr.parameters(), 1.0)
            opt.step()
            if ema is not None:
                with torch.no_grad():
                    for k, v in dr.state_dict().items():
                        ema[k].lerp_(v, 1.0 - cfg["ema"])
            step += 1
            if step % 100 == 0 or step == total:
                curve.append((step, round(loss.item(), 4)))
    train_s = time.time() - t0
    if ema is not None:
        dr.load_state_dict(ema)
    dr.eval()
    accs = []
    with torch.no_grad():
        for i in range(len(held)):
            fx, ids_t, pos, mask, labels, w = batch_of([held[i]], [hf[i]], cfg, rng, all_anchors=True)
            accs.append(sim_accept(dr(fx, head[ids_t], pos, mask), head, labels, w, B))
        held_sim = torch.cat(accs).mean().item()
        accs = []
        for i in range(0, len(train), 8):
            fx, ids_t, pos, mask, labels, w = batch_of(train[i:i + 8], tf[i:i + 8], cfg, rng, all_anchors=True)
            accs.append(sim_accept(dr(fx, head[ids_t], pos, mask), head, labels, w, B))
        train_sim = torch.cat(accs).mean().item()
    return dict(held_sim=round(held_sim, 4), train_sim=round(train_sim, 4), train_s=round(train_s, 1),
                layer_ids=ids_l, curve=curve)


def first_user(ids):
    # <|im_start|> is id 1; the second one opens the first user turn.
    starts = [i for i, t in enumerate(ids) if t == 1]
    return starts[1] if len(starts) > 1 else 0


def tokenize(a):
    from tokenizers import Tokenizer

    from dflash_reference import encode
    tok = Tokenizer.from_file(os.path.join(a.target, "tokenizer.json"))
    n = 0
    with open(a.out, "w") as f:
        for line in open(a.data):
            if line.strip():
                ids, lm = encode(tok, json.loads(line)["messages"])
                ids, lm = ids[:a.max_len], lm[:a.max_len]
                if sum(lm) >= 2:
                    f.write(json.dumps({"ids": ids, "mask": lm}) + "\n")
                    n += 1
    print(f"{n} sequences -> {a.out}")


def read_tok(path):
    out = []
    for line in open(path):
        if line.strip():
            r = json.loads(line)
            out.append((r["ids"], r["mask"]))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--train")
    ap.add_argument("--heldout")
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--one", default="")
    ap.add_argument("--extra", default="{}", help="JSON overrides applied to every config")
    ap.add_argument("--tokenize", default="", help="JSONL of conversations to tokenize into --out")
    ap.add_argument("--max-len", type=int, default=512)
    a = ap.parse_args()
    if a.tokenize:
        a.data = a.tokenize
        return tokenize(a)
    if a.one:
        cfg = dict(BASE)
        cfg.update(CONFIGS.get(a.one, {}))
        cfg.update(json.loads(a.extra))
        if a.one not in CONFIGS:
            cfg.update(json.loads(a.one))
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        r = run(cfg, a.target, read_tok(a.train), read_tok(a.heldout), dev)
        r["config"] = cfg
        print(json.dumps(r), flush=True)
        return
    names = [n for n in a.configs.split(",") if n]
    results, running = {}, []
    while names or running:
        while names and len(running) < a.jobs:
            n = names.pop(0)
            p = subprocess.Popen([sys.executable, __file__, "--target", a.target, "--train", a.train, "--heldout",
                                  a.heldout, "--out", a.out, "--one", n, "--extra", a.extra],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            running.append((n, p))
        time.sleep(1)
        for n, p in list(running):
            if p.poll() is not None:
                running.remove((n, p))
                out, err = p.communicate()
                try:
                    results[n] = json.loads(out.strip().splitlines()[-1])
                except Exception:
                    results[n] = {"error": err[-2000:]}
                r = results[n]
                print(f"{n:12s} held-out sim {r.get('held_sim')} train sim {r.get('train_sim')} "
                      f"train {r.get('train_s')} s {r.get('error', '')[-300:]}", flush=True)
                json.dump(results, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
