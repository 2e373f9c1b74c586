#!/usr/bin/env bash
# Proves the opt-in `cuda` feature compiles: candle's CUDA backend with its kernels compiled
# to PTX by nvcc, stoker-gpu's own kernels compiled by nvcc to an sm_90 fatbin (and its
# cudarc backend), then stoker-kernels, stoker-train, stoker-comm (NCCL) and stoker-cli with
# every target. Compiling needs no GPU; running needs one (none here).
#
# nvcc comes from NVIDIA's PyPI wheels, pinned to CUDA 13.0: the lent H200's driver (580,
# CUDA 13.0) loads PTX up to ISA 9.0, and 13.1+ nvcc emits newer PTX it cannot load. The
# toolkit and the cargo target directory (candle's compiled kernels: minutes of nvcc) live
# in a cache outside the checkout, keyed by the toolkit version, so reruns and fresh
# clones on the same machine skip nvcc: ${STOKER_CACHE_DIR:-~/.cache/stoker}.
# Usage: bash scripts/check-cuda.sh [--if-available]   (make check-cuda; make test passes
# --if-available: where the wheels cannot be fetched, it says so and skips instead of failing)
set -euo pipefail
cd "$(dirname "$0")/.."
optional=false
[ "${1:-}" = "--if-available" ] && optional=true
version=13.0.88
cache=${STOKER_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/stoker}
tk=$cache/cuda-$version
if [ ! -x "$tk/nvidia/cu13/bin/nvcc" ] || [ ! -x "$tk/nvidia/cu13/nvvm/bin/cicc" ]; then
  rm -rf "$tk"
  mkdir -p "$cache"
  if ! python3 -m pip install -q --no-deps --timeout 30 --retries 2 --target "$tk" \
    nvidia-cuda-nvcc==$version nvidia-cuda-crt==$version nvidia-nvvm==$version \
    nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 >"$tk.log" 2>&1; then
    echo "cuda compile check: could not install NVIDIA's nvcc wheels from PyPI (see $tk.log)"
    rm -rf "$tk"
    if $optional; then
      echo "cuda compile check SKIPPED: no CUDA toolkit on this machine"
      exit 0
    fi
    exit 1
  fi
fi
export PATH="$tk/nvidia/cu13/bin:$PATH" CUDA_ROOT="$tk/nvidia/cu13" CUDA_PATH="$tk/nvidia/cu13"
# No GPU to ask: compile the PTX for Hopper (H100 / H200), the device these runs target.
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
# candle-kernels' build (cudaforge) runs nvcc on half the cores unless told: on CI's two,
# one file at a time (docs/benchmarks.md, "The test suite's build").
export CUDAFORGE_THREADS=${CUDAFORGE_THREADS:-$(nproc)}
nvcc --version | tail -1
cargo check -p stoker-kernels -p stoker-gpu -p stoker-train -p stoker-comm -p stoker-cli --features cuda --all-targets \
  --target-dir "$cache/target-cuda-$version" 2>&1
