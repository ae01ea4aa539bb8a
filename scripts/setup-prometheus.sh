#!/usr/bin/env bash
# Prometheus and promtool for the suite's scrape and alerting-rule tests
# (tests/tests/prometheus.rs): Debian's prometheus package, fetched with apt
# (or straight from the Debian archive), checked against its sha256 and
# unpacked without root. Only the two binaries are kept (both link libc
# alone). Cached; a second run is a no-op. Prints the bin folder on stdout.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
dest=${DFLASH_PROMETHEUS_DIR:-$root/.cache/prometheus}
version="2.42.0+ds-5+deb12u1"
sha256="81d59a24fce84f7fbe97a45a4f2914b6a5881b5cd1db2a6a0e129e515e1a5f55"
deb="prometheus_${version}_amd64.deb"

if [ -x "$dest/bin/prometheus" ] && [ -x "$dest/bin/promtool" ]; then
  echo "$dest/bin"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
if ! apt-get download "prometheus=$version" >/dev/null 2>&1; then
  echo "fetching $deb from deb.debian.org ..." >&2
  curl -fsSL -o "$deb" "https://deb.debian.org/debian/pool/main/p/prometheus/${deb//+/%2B}"
fi
echo "$sha256  $(ls prometheus_*.deb)" | sha256sum -c --quiet
dpkg-deb -x prometheus_*.deb unpacked
mkdir -p "$dest/bin"
mv unpacked/usr/bin/prometheus unpacked/usr/bin/promtool "$dest/bin/"
echo "$dest/bin"
