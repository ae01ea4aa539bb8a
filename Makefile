# The two commands of the README, and their parts.
#   make up    - the one-machine run (installs libtorch, prepares the model and data)
#   make test  - the test suite (what CI runs)

CONFIG ?= deploy/configs/cpu-synthetic.toml
PREPARE ?= synthetic

.PHONY: up test build libtorch clean-runs

libtorch:
	@scripts/setup-libtorch.sh >/dev/null

build: libtorch
	cargo build --release --bins

up: build
	target/release/dflash up --config $(CONFIG) --prepare $(PREPARE)

test: build
	cargo nextest run --release --workspace --no-fail-fast

clean-runs:
	rm -rf runs
