#!/usr/bin/env bash
# Builds the dflash image: the local base (build-base.sh), the binaries
# (from this checkout's release build, or from source with --from-source),
# and the runtime image. Prints the image tag.
#
# Usage: deploy/docker/build-images.sh [--from-source] [tag]   (default dflash:local)
# Environment: BASE_IMAGE, BUILDER_IMAGE, TORCH_VARIANT (see the Dockerfiles).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
from_source=false
if [ "${1:-}" = "--from-source" ]; then from_source=true; shift; fi
tag=${1:-dflash:local}
base=${BASE_IMAGE:-dflash-base:bookworm}
binaries=dflash-binaries:local

if [ "$base" = dflash-base:bookworm ]; then
  "$root/deploy/docker/build-base.sh" "$base" >/dev/null
fi
if $from_source; then
  docker build -q -f "$root/deploy/docker/binaries.Dockerfile" \
    --build-arg "BUILDER_IMAGE=${BUILDER_IMAGE:-rust:1.95-bookworm}" -t "$binaries" "$root" >&2
else
  stage="$root/.cache/docker/stage"
  "$root/deploy/docker/stage.sh" "$stage"
  docker build -q -f "$root/deploy/docker/prebuilt.Dockerfile" -t "$binaries" "$stage" >&2
fi
docker build -q -f "$root/deploy/docker/Dockerfile" \
  --build-arg "BINARIES_IMAGE=$binaries" --build-arg "BASE_IMAGE=$base" \
  --build-arg "TORCH_VARIANT=${TORCH_VARIANT:-cpu}" -t "$tag" "$root/deploy/docker" >&2
echo "$tag"
