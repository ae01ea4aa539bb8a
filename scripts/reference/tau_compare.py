"""Compares drafters scored by `dflash eval --json` on the same prompts: the
tau of each (tokens over verify steps, as eval prints it) and, against the
first, a paired bootstrap over the prompts of the difference in tau (each
draw resamples the prompts once for every drafter, so the pairing holds).

    python3 scripts/reference/tau_compare.py BASE.json OTHER.json [...] [--draws N] [--seed S]

Tau is a ratio of sums, so a draw recomputes it from the drawn prompts'
tokens and steps rather than averaging per-prompt taus. The interval covers
which prompts were drawn, not how training would vary on a rerun: that needs
runs of their own.
"""
import argparse
import json
import random
import sys


def per_prompt(path):
    """{prompt id: (tokens, verify steps)} of the trained drafter's decodes."""
    report = json.load(open(path))
    trained = next((r for r in report["reports"] if r["label"] == "trained"), None)
    if trained is None:
        sys.exit(f"{path}: no 'trained' report (run eval with --drafter)")
    return {d["id"]: (sum(d["per_step"]), len(d["per_step"])) for d in trained["decodes"]}


def tau(rows, ids):
    return sum(rows[i][0] for i in ids) / sum(rows[i][1] for i in ids)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reports", nargs="+", help="eval --json reports; the first is the base")
    p.add_argument("--draws", type=int, default=10000)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    runs = [(path, per_prompt(path)) for path in a.reports]
    ids = sorted(runs[0][1])
    for path, rows in runs[1:]:
        if sorted(rows) != ids:
            sys.exit(f"{path}: other prompts than {runs[0][0]} ({len(rows)} against {len(ids)})")
    rng = random.Random(a.seed)
    draws = [[rng.choice(ids) for _ in ids] for _ in range(a.draws)]
    base_path, base = runs[0]
    print(f"{len(ids)} prompts; base {base_path}: tau {tau(base, ids):.3f}")
    for path, rows in runs[1:]:
        diffs = sorted(tau(rows, d) - tau(base, d) for d in draws)
        lo, hi = diffs[int(0.025 * len(diffs))], diffs[int(0.975 * len(diffs)) - 1]
        print(f"{path}: tau {tau(rows, ids):.3f}, minus base {tau(rows, ids) - tau(base, ids):+.3f} "
              f"(95% {lo:+.3f}..{hi:+.3f})")


if __name__ == "__main__":
    main()
