# The two commands of the README, and their parts.
#   make up    - the one-machine run: libtorch, SmolLM2, the corpora, training, evaluation
#   make test  - the test suite (what CI runs)

.PHONY: up test build libtorch prometheus demo-synthetic clean-runs

libtorch:
	@scripts/setup-libtorch.sh >/dev/null
	@scripts/setup-gloo-headers.sh >/dev/null

prometheus:
	@scripts/setup-prometheus.sh >/dev/null

build: libtorch
	cargo build --release --bins

up: build
	target/release/dflash up --config deploy/configs/cpu-smollm2.toml --prepare smollm2-chitchat \
		--target-threads 1 --drafter-threads 2 --workdir runs/cpu-smollm2

demo-synthetic: build
	target/release/dflash up --config deploy/configs/cpu-synthetic.toml --prepare synthetic \
		--workdir runs/cpu-synthetic

test: build prometheus
	cargo nextest run --release --workspace --no-fail-fast

clean-runs:
	rm -rf runs
