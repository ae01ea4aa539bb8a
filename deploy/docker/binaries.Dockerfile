# Builds the release binaries from source with cargo, and keeps only what
# the runtime image needs (multi-stage: the toolchain stays behind).
#
#   BUILDER_IMAGE  a Rust 1.95 image with gcc, g++, make and python3-pip
#                  (rust:1.95-bookworm where a registry is reachable).
#
# docker build -f deploy/docker/binaries.Dockerfile -t dflash-binaries:local .
ARG BUILDER_IMAGE=rust:1.95-bookworm
FROM ${BUILDER_IMAGE} AS build
WORKDIR /src
COPY . .
# setup-libtorch.sh fetches the torch wheel from PyPI.
RUN scripts/setup-libtorch.sh \
    && cargo build --release --bins \
    && deploy/docker/stage.sh /opt/dflash

FROM scratch
COPY --from=build /opt/dflash /opt/dflash
