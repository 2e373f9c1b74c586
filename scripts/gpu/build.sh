#!/usr/bin/env bash
# Builds the `stoker` binary with the `cuda` feature into target/gpu/stoker, for carrying to
# a lent GPU machine (which has a driver and NVIDIA's PyPI libraries but no Rust). Needs no
# GPU: candle's kernels are compiled to PTX for Hopper by nvcc 13.0 (the toolkit that
# scripts/check-cuda.sh installs from PyPI; the H200's driver 580 loads its PTX).
#
# candle makes cudarc link its libraries at build time (`dynamic-linking`): cuBLAS,
# cuBLASLt, cuRAND, NVRTC, NCCL and the CUDA runtime come from NVIDIA's PyPI wheels (CUDA
# 13.0, into the cache), given their unversioned names for the linker. The driver library
# (libcuda.so) ships only with a driver, so the link step gets a stub: a shared library
# with libcuda.so.1's soname defining every cu* function cudarc declares (from its own
# bindings), each doing nothing. At run time the machine's driver library, of the same
# soname, is loaded instead. A cold build takes about 10 minutes on 2 cores (nvcc).
# Usage: bash scripts/gpu/build.sh   (then scripts/gpu/offload-check.sh on the GPU machine)
set -euo pipefail
cd "$(dirname "$0")/../.."
version=13.0.88
cache=${STOKER_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/stoker}
tk=$cache/cuda-$version
bash scripts/check-cuda.sh > /dev/null # installs the toolkit (and keeps the check honest)
export PATH="$tk/nvidia/cu13/bin:$PATH" CUDA_ROOT="$tk/nvidia/cu13" CUDA_PATH="$tk/nvidia/cu13"
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
# candle-kernels' build (cudaforge) runs nvcc on half the cores unless told: on CI's two,
# one file at a time (docs/benchmarks.md, "The test suite's build").
export CUDAFORGE_THREADS=${CUDAFORGE_THREADS:-$(nproc)}

libs=$cache/cuda-link-$version
if [ ! -f "$libs/.complete" ]; then
  rm -rf "$libs"
  if ! python3 -m pip install -q --no-deps --timeout 30 --retries 2 --target "$libs" \
    nvidia-cublas==13.0.2.14 nvidia-cuda-nvrtc==$version nvidia-curand==10.4.0.35 \
    nvidia-nccl-cu13==2.30.7 > "$libs.log" 2>&1; then
    echo "gpu build: could not install the CUDA libraries from PyPI (see $libs.log)"
    exit 1
  fi
  touch "$libs/.complete"
fi

stub=$cache/libcuda-stub
rm -rf "$stub" && mkdir -p "$stub"
find "$libs/nvidia" "$tk/nvidia" -name 'lib*.so.*' | while read -r f; do
  b=$(basename "$f")
  ln -sf "$f" "$stub/${b%%.so*}.so"
done
cudarc_version=$(grep -A1 '^name = "cudarc"$' Cargo.lock | sed -n 's/^version = "\(.*\)"$/\1/p')
cudarc=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/"cudarc-$cudarc_version" | head -1)
grep -o '^pub unsafe fn cu[A-Za-z0-9_]*' "$cudarc/src/driver/sys/mod.rs" | sed 's/^pub unsafe fn //' |
  sort -u | sed 's/.*/int &(void) { return 999; }/' > "$stub/libcuda-stub.c"
echo "gpu build: a link-time libcuda.so stub of $(wc -l < "$stub/libcuda-stub.c") driver functions"
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$stub/libcuda.so" "$stub/libcuda-stub.c"

RUSTFLAGS="-L native=$stub -L native=$tk/nvidia/cu13/lib" \
  cargo build --release -p stoker-cli --features cuda --target-dir "$cache/target-gpu-$version"
# Stripped it is about 64 MB (32 MB of it candle's compiled kernels), the device tool's
# whole carry limit: it travels xz-compressed (about 9 MB) beside data/shakespeare.
bin=$cache/target-gpu-$version/release/stoker-stripped
cp "$cache/target-gpu-$version/release/stoker" "$bin"
strip "$bin"
echo "gpu build: the CUDA libraries it loads at run time:"
ldd "$bin" | grep -E 'cuda|cublas|curand|nvrtc|nccl|cudart' || true
rm -rf target/gpu && mkdir -p target/gpu
xz -T2 -6 -c "$bin" > target/gpu/stoker.xz
# The GPU machine has the driver, glibc and NVIDIA's PyPI libraries, not this machine's
# Debian packages (MPICH and UCX, libjpeg-turbo, hwloc, ...): they travel beside it.
libs_dir=$(mktemp -d)
ldd "$bin" | awk '/=> \// {print $3}' |
  grep -v -E '/(libc|libm|libgcc_s|libstdc\+\+|ld-linux[^/]*|libcuda|libcudart|libcublas|libcublasLt|libcurand|libnvrtc|libnccl)\.so' |
  while read -r f; do cp -L "$f" "$libs_dir/"; done
tar -C "$libs_dir" -cJf target/gpu/libs.tar.xz .
echo "gpu build: shared libraries that travel with it: $(ls "$libs_dir" | tr '\n' ' ')"
rm -rf "$libs_dir"
ls -l "$bin" target/gpu/
echo "gpu build: carry target/gpu and data/shakespeare; there, bash scripts/gpu/device-check.sh kernels (then resident, step-time, offload, ranks)"
