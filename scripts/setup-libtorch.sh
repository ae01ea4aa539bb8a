#!/usr/bin/env bash
# Assembles the libtorch 2.11 folder that tch 0.24 builds and runs against,
# from the PyPI torch wheel: headers, the CPU
# libraries, the two CUDA runtime libraries libtorch_cpu.so needs even on a
# CPU-only machine, and a stub libtorch.so so the linker does not pull in
# libtorch_cuda.so. The result is cached; a second run is a no-op.
# Prints the folder on stdout.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
dest=${LIBTORCH:-$root/.cache/libtorch}
wheels=${DFLASH_WHEEL_CACHE:-$root/.cache/wheels}

if [ -f "$dest/.complete" ]; then
  echo "$dest"
  exit 0
fi

mkdir -p "$wheels"
# pip matches --platform tags exactly, so name every manylinux level the
# wheels use (torch: 2_28, cudart: 2_17/2014, cupti: 2_25).
platforms=""
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_25 manylinux_2_24 manylinux_2_17 manylinux2014; do
  platforms+=" --platform ${tag}_x86_64"
done
fetch() {  # fetch <requirement> <glob>: download a wheel unless cached
  if ! ls "$wheels"/$2 >/dev/null 2>&1; then
    echo "fetching $1 ..." >&2
    python3 -m pip download --quiet --no-deps --only-binary=:all: \
      --python-version 3.11 $platforms \
      -d "$wheels" "$1" >&2
  fi
  ls "$wheels"/$2 | head -n 1
}
torch_whl=$(fetch "torch==2.11.0" "torch-2.11.0-*.whl")
cudart_whl=$(fetch "nvidia-cuda-runtime==13.0.96.*" "nvidia_cuda_runtime-13.0.96-*.whl")
cupti_whl=$(fetch "nvidia-cuda-cupti==13.0.85.*" "nvidia_cuda_cupti-13.0.85-*.whl")

tmp=$(mktemp -d "${dest}.tmp.XXXX")
trap 'rm -rf "$tmp"' EXIT
echo "assembling libtorch in $dest ..." >&2
python3 - "$torch_whl" "$cudart_whl" "$cupti_whl" "$tmp" <<'PY'
import os, shutil, sys, zipfile
torch_whl, cudart_whl, cupti_whl, out = sys.argv[1:]
os.makedirs(os.path.join(out, "lib"), exist_ok=True)
wanted_libs = {"torch/lib/libc10.so", "torch/lib/libtorch_cpu.so", "torch/lib/libgomp.so.1"}
with zipfile.ZipFile(torch_whl) as z:
    for name in z.namelist():
        if name.startswith("torch/include/") and not name.endswith("/"):
            target = os.path.join(out, name[len("torch/"):])
        elif name in wanted_libs:
            target = os.path.join(out, "lib", os.path.basename(name))
        else:
            continue
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with z.open(name) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)
for whl, lib in ((cudart_whl, "libcudart.so.13"), (cupti_whl, "libcupti.so.13")):
    with zipfile.ZipFile(whl) as z:
        member = next(n for n in z.namelist() if n.endswith("/" + lib))
        with z.open(member) as src, open(os.path.join(out, "lib", lib), "wb") as dst:
            shutil.copyfileobj(src, dst)
PY
# The wheel's libtorch.so links libtorch_cuda.so; an empty stub satisfies the
# linker, which then drops it (--as-needed), so binaries need only
# libtorch_cpu.so + libc10.so and find CUDA at run time via dlopen.
echo | gcc -shared -x c - -o "$tmp/lib/libtorch.so"
touch "$tmp/.complete"
rm -rf "$dest"
mv "$tmp" "$dest"
trap - EXIT
echo "$dest"
