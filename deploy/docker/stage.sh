#!/usr/bin/env bash
# Collects what the runtime image needs into <dest>: the release binaries
# (bin/) and the CPU half of libtorch (libtorch/lib/). Hard links where the
# file system allows, so staging costs no copy.
# Usage: deploy/docker/stage.sh <dest>
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dest=${1:?usage: stage.sh <dest>}
libtorch=${LIBTORCH:-$root/.cache/libtorch}
rm -rf "$dest"
mkdir -p "$dest/bin" "$dest/libtorch/lib"
for b in dflash dflash-coordinator dflash-target dflash-drafter; do
  src="$root/target/release/$b"
  [ -x "$src" ] || { echo "stage.sh: $src is missing: cargo build --release --bins" >&2; exit 1; }
  cp -l "$src" "$dest/bin/" 2>/dev/null || cp "$src" "$dest/bin/"
done
for l in libc10.so libtorch_cpu.so libgomp.so.1 libcudart.so.13 libcupti.so.13; do
  [ -f "$libtorch/lib/$l" ] || { echo "stage.sh: $libtorch/lib/$l is missing: scripts/setup-libtorch.sh" >&2; exit 1; }
  cp -l "$libtorch/lib/$l" "$dest/libtorch/lib/" 2>/dev/null || cp "$libtorch/lib/$l" "$dest/libtorch/lib/"
done
