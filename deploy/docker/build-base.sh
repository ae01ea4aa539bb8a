#!/usr/bin/env bash
# Builds the local base image the dflash images start from. These machines
# reach no container registry, so the base is made here: a minimal Debian
# bookworm root file system from debootstrap (through Debian's package
# mirror), imported into Docker. Where a registry is reachable, pass any
# image instead (BASE_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04 for GPUs).
#
# Usage: deploy/docker/build-base.sh [image-tag]   (default dflash-base:bookworm)
# Needs root (debootstrap; apt installs debootstrap when it is missing).
# The root file system is cached as .cache/docker/base-rootfs.tar.
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
tag=${1:-dflash-base:bookworm}
cache="$root/.cache/docker"
tarball="$cache/base-rootfs.tar"
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

if docker image inspect "$tag" >/dev/null 2>&1; then
  echo "$tag exists" >&2
  exit 0
fi
mkdir -p "$cache"
if [ ! -f "$tarball" ]; then
  if ! command -v debootstrap >/dev/null; then
    echo "installing debootstrap ..." >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >&2 \
      || { apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >&2; }
  fi
  rootfs=$(mktemp -d "$cache/rootfs.XXXX")
  trap 'rm -rf "$rootfs"' EXIT
  echo "debootstrap bookworm into $rootfs ..." >&2
  # ca-certificates for TLS to peers; libgomp1 for libtorch's OpenMP.
  debootstrap --variant=minbase --include=ca-certificates,libgomp1 bookworm "$rootfs" "$mirror" >&2
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -cf "$tarball.tmp" .
  mv "$tarball.tmp" "$tarball"
fi
echo "importing $tag ..." >&2
docker import "$tarball" "$tag" >/dev/null
echo "$tag"
