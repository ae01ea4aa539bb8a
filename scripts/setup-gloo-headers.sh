#!/usr/bin/env bash
# Gloo's C++ headers for the drafter group's CPU collectives. libtorch_cpu.so
# already contains PyTorch's Gloo process group (c10d::ProcessGroupGloo) and
# Gloo itself, but the PyPI wheel ships without Gloo's headers, which
# ProcessGroupGloo.hpp includes. Debian's libgloo-dev provides them; only the
# headers are used (nothing links libgloo.so: the code is libtorch's). The
# package is fetched with apt (or straight from the Debian archive, checked
# against its sha256) and unpacked without root. Cached; a second run is a
# no-op. Prints the include folder on stdout.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
dest=${DFLASH_GLOO_DIR:-$root/.cache/gloo}
version="0.0~git20220518.5b14351-3"
sha256="80529c9fd8af452faf489e686b94bf87075965c40673803810c4f41634b1e299"
deb="libgloo-dev_${version}_amd64.deb"

if [ -f "$dest/include/gloo/context.h" ]; then
  echo "$dest/include"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
if ! apt-get download "libgloo-dev=$version" >/dev/null 2>&1; then
  echo "fetching $deb from deb.debian.org ..." >&2
  curl -fsSL -o "$deb" "https://deb.debian.org/debian/pool/main/g/gloo/${deb//\~/%7E}"
fi
echo "$sha256  $(ls libgloo-dev_*.deb)" | sha256sum -c --quiet
dpkg-deb -x libgloo-dev_*.deb unpacked
mkdir -p "$dest"
rm -rf "$dest/include"
mv unpacked/usr/include "$dest/include"
echo "$dest/include"
