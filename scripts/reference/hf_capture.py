"""Hugging Face transformers' own forward of the model shape and batches a
`dflash-target bench-capture --json` run measured: the reference capture
figure (random bf16 weights, one sequence at a time, every layer, hidden
states on, no LM head), side by side with ours.

    python3 scripts/reference/hf_capture.py --bench capture.json --json hf.json

Prints tokens/s and MFU (FLOPs counted as bench-capture counts them, from
the per-layer counts its JSON carries: the linear layers a token passes
through -- for MoE layers the router and the experts it is routed to -- plus
the visible query-key pairs of softmax-attention layers -- the causal half,
within the window of sliding layers -- over the layers each implementation
runs). Hybrid targets run transformers' torch
path, or flash-linear-attention's kernels when `fla` is importable (the
JSON says which).
"""
import argparse
import importlib.util
import json
import time

import torch
import transformers
from transformers import AutoConfig, AutoModel


def layer_macs(c, i):
    h, hd = c["hidden_size"], c["head_dim"]
    qd, kvd = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    attn = h * qd * 2 + h * kvd * 2
    experts = c.get("num_experts", 0)
    sparse = experts > 0 and i not in c.get("mlp_only_layers", []) and (i + 1) % c.get("decoder_sparse_step", 1) == 0
    if sparse:
        return attn + h * experts + c["num_experts_per_tok"] * 3 * h * c["moe_intermediate_size"]
    return attn + 3 * h * c["intermediate_size"]


def visible_pairs(l, window):
    """Query-key pairs causal attention computes over l tokens (within a window)."""
    if window is None or window >= l:
        return l * (l + 1) / 2
    return window * (window + 1) / 2 + (l - window) * window


def flops(c, layers, lens, bench=None):
    tokens = sum(lens)
    if bench and "layer_linear_macs" in bench:
        macs, pair, window = bench["layer_linear_macs"], bench["attention_pair_flops"], bench["attention_window"]
        return sum(
            2 * macs[i] * tokens + sum(pair[i] * visible_pairs(l, window[i]) for l in lens) for i in range(layers)
        )
    qd = c["num_attention_heads"] * c["head_dim"]
    attn = sum(4 * qd * l * (l + 1) / 2 for l in lens)
    return sum(2 * layer_macs(c, i) * tokens + attn for i in range(layers))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", required=True, help="bench-capture --json output")
    ap.add_argument("--json")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--batches", type=int, default=0, help="time only the first N batches (0: all)")
    ap.add_argument("--attn", default="sdpa", help="attn_implementation (gpt-oss's sinks need eager)")
    a = ap.parse_args()
    bench = json.load(open(a.bench))
    c = dict(bench["target_config"])
    cfg = dict(c)
    model_type = cfg.pop("model_type")
    cfg.pop("architectures", None)
    cfg.pop("torch_dtype", None)
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModel.from_config(config, dtype=torch.bfloat16, attn_implementation=a.attn)
    model.eval()
    batches = bench["timed_seq_lengths"]
    if a.batches:
        batches = batches[: a.batches]
    vocab = c["vocab_size"]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def run(lens):
        for l in lens:
            ids = torch.randint(0, vocab, (1, l), device="cuda", generator=gen)
            model(ids, output_hidden_states=True)

    with torch.no_grad():
        for lens in batches[: a.warmup]:
            run(lens)
        torch.cuda.synchronize()
        times = []
        for lens in batches:
            t0 = time.perf_counter()
            run(lens)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    tokens = sum(sum(l) for l in batches)
    total = sum(times)
    peak = bench["matmul_peak_flops"]
    all_lens = [l for lens in batches for l in lens]
    n_layers = c["num_hidden_layers"]
    hf_mfu = flops(c, n_layers, all_lens, bench) / total / peak
    ours = {r["mode"]: r for r in bench["results"]}
    best = ours.get("async") or ours.get("off")
    ours_layers = max(bench["captured_layers"]) + 1
    out = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "shape": bench["shape"],
        "experts_implementation": getattr(model.config, "_experts_implementation", None),
        "fla": importlib.util.find_spec("fla") is not None,
        "attn_implementation": a.attn,
        "hf_layers": n_layers,
        "hf_tokens_per_s": tokens / total,
        "hf_mfu": hf_mfu,
        "hf_batch_s": times,
        "dflash_layers": ours_layers,
        "dflash_mode": best["mode"],
        "dflash_tokens_per_s": best["tokens_per_s"],
        "dflash_mfu": best["mfu"],
        "speedup": best["tokens_per_s"] / (tokens / total),
    }
    print(
        f"{bench['shape']}: transformers {transformers.__version__} {out['hf_tokens_per_s']:.0f} tokens/s "
        f"({100 * hf_mfu:.1f}% MFU, {n_layers} layers, experts {out['experts_implementation']}, fla {out['fla']}); "
        f"dflash {best['mode']} {best['tokens_per_s']:.0f} tokens/s ({100 * best['mfu']:.1f}% MFU, {ours_layers} layers): "
        f"{out['speedup']:.2f}x"
    )
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
