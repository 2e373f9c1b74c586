#!/usr/bin/env bash
# Builds the `stoker` binary with the `cuda` feature into target/gpu/stoker, for carrying to
# a lent GPU machine (which has a driver and NVIDIA's PyPI libraries but no Rust). Needs no
# GPU: candle's kernels are compiled to PTX for Hopper by nvcc 13.0 (the toolkit that
# scripts/check-cuda.sh installs from PyPI; the H200's driver 580 loads its PTX).
#
# candle links the CUDA driver library (libcuda.so) at build time, and only a driver
# install ships it. The link step gets a stub instead: a shared library named libcuda.so.1
# that defines every cu* symbol the link asks for and does nothing. At run time the
# machine's own driver library (same soname) is loaded. The symbols come from the link
# itself: a first link lists what is undefined, the stub defines exactly those.
# Usage: bash scripts/gpu/build.sh   (then: scripts/gpu/offload-check.sh on the GPU machine)
set -euo pipefail
cd "$(dirname "$0")/../.."
version=13.0.88
cache=${STOKER_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/stoker}
tk=$cache/cuda-$version
bash scripts/check-cuda.sh > /dev/null # installs the toolkit (and keeps the check honest)
export PATH="$tk/nvidia/cu13/bin:$PATH" CUDA_ROOT="$tk/nvidia/cu13" CUDA_PATH="$tk/nvidia/cu13"
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
target=$cache/target-gpu-$version
stub=$cache/libcuda-stub
mkdir -p "$stub"
# The runtime's own libraries (cuBLAS, cuRAND, NVRTC, cudart) are in the PyPI tree.
rt_libs=$(find "$tk/nvidia" -name 'lib*.so*' -printf '%h\n' | sort -u | tr '\n' ':')

build() {
  RUSTFLAGS="-L native=$stub ${rt_libs:+$(printf -- '-L native=%s ' ${rt_libs//:/ })}" \
    cargo build --release -p stoker-cli --features cuda --target-dir "$target" 2>&1
}
# A stub with no symbols first, so that the link names what it needs.
if [ ! -e "$stub/libcuda.so" ]; then
  echo 'void stoker_cuda_stub(void) {}' > "$stub/stub.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$stub/libcuda.so" "$stub/stub.c"
fi
if ! log=$(build); then
  syms=$(grep -o "undefined reference to \`cu[A-Za-z0-9_]*'" <<<"$log" | sed "s/.*\`//; s/'//" | sort -u)
  if [ -z "$syms" ]; then
    echo "$log" | tail -40
    echo "gpu build: failed for another reason than the driver's symbols (above)"
    exit 1
  fi
  echo "gpu build: stubbing $(wc -w <<<"$syms") CUDA driver symbols for the link"
  for s in $syms; do echo "int $s(void) { return 999; }"; done > "$stub/stub.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$stub/libcuda.so" "$stub/stub.c"
  build | tail -5
fi
mkdir -p target/gpu
cp "$target/release/stoker" target/gpu/stoker
strip target/gpu/stoker
ls -l target/gpu/stoker
echo "gpu build: target/gpu/stoker; carry it with data/shakespeare and run scripts/gpu/offload-check.sh"
