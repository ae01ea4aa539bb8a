"""Compares `dflash-target inspect --json` output with a fixture's
reference.safetensors (made by tests/fixtures/make_fixtures.py): prints the
relative error of the logits and of each layer written.

    python3 scripts/reference/compare_inspect.py tests/fixtures/NAME out.json
"""
import json
import sys

import torch
from safetensors.torch import load_file

ref = load_file(sys.argv[1] + "/reference.safetensors")
got = json.load(open(sys.argv[2]))


def rel(a, b):
    a, b = torch.tensor(a, dtype=torch.float64), b.double()
    return ((a - b).abs().max() / b.abs().max()).item()


errs = {"logits": rel(got["logits"], ref["logits"])}
for k, v in got["layers"].items():
    errs[f"layer {k}"] = rel(v, ref[f"hidden.{k}"])
print(sys.argv[1].rstrip("/").split("/")[-1], " ".join(f"{k} {v:.2e}" for k, v in errs.items()))
