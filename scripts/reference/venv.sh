#!/usr/bin/env bash
# The reference Python environment the tests and scripts run against (never
# imported by the project's code): PyTorch 2.11 (the wheel setup-libtorch.sh
# caches, its CUDA dependencies from PyPI: it runs on CPUs too),
# transformers, pyarrow (Parquet files as Hugging Face datasets writes them),
# and the DFlash authors' `dflash` package and SpecForge installed without
# their dependencies (both run with torch + transformers alone). Cached in .cache/ref-venv; a second run is a no-op. Prints the
# folder's python on stdout. Several callers at once wait for one install.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
venv=${DFLASH_REF_VENV:-$root/.cache/ref-venv}
wheels=${DFLASH_WHEEL_CACHE:-$root/.cache/wheels}
mkdir -p "$(dirname "$venv")"
# transformers 5.25 is the first whose linear-attention cache restores the
# recurrent state when decoding goes back (the hybrid public-client test).
transformers_version=${DFLASH_REF_TRANSFORMERS:-5.25.0}
exec 9>"$venv.lock"
flock 9
# A venv cached for another transformers is made again.
if [ -f "$venv/.complete" ] && [ "$(cat "$venv/.complete")" != "transformers==$transformers_version" ]; then
  rm -f "$venv/.complete"
fi
if [ ! -f "$venv/.complete" ]; then
  rm -rf "$venv"
  echo "installing the reference venv into $venv (torch, transformers, dflash, specforge) ..." >&2
  python3 -m venv "$venv"
  pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@" >&2; }
  torch_whl=$(ls "$wheels"/torch-2.11.0-*.whl 2>/dev/null | head -n 1 || true)
  pip install "${torch_whl:-torch==2.11.0}" "transformers==$transformers_version" "safetensors" "numpy"
  pip install --no-deps "dflash==0.1.0" "specforge==0.2.0"
  "$venv/bin/python" -c "import torch, transformers, dflash; from dflash.model import DFlashDraftModel" >&2
  echo "transformers==$transformers_version" > "$venv/.complete"
fi
# Added after the first release of this venv: installed into existing ones too.
if ! "$venv/bin/python" -c "import pyarrow" 2>/dev/null; then
  echo "adding pyarrow (Parquet fixtures) to $venv ..." >&2
  "$venv/bin/python" -m pip --disable-pip-version-check -q install "pyarrow==21.0.0" >&2
fi
echo "$venv/bin/python"
