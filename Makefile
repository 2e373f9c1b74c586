# stoker: every target installs what it needs before it runs.
SHELL := /bin/bash
CARGO ?= cargo
PYTHON ?= python3
STOKER := target/release/stoker

.PHONY: demo test deps data build release bench-loader fmt clippy

deps:
	bash scripts/install-deps.sh

data: deps
	bash scripts/fetch-data.sh

release: deps
	$(CARGO) build --release -p stoker-cli

# The main job: pack MNIST and benchmark the loader on it.
demo: data release
	bash scripts/demo.sh

# The test suite: deterministic, asserts real values, no GPU needed.
test: deps
	bash scripts/test.sh

fmt:
	$(CARGO) fmt --all

clippy:
	$(CARGO) clippy --workspace --all-targets -- -D warnings
