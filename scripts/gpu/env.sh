# Sourced by the GPU checks (scripts/gpu/*-check.sh, step-time.sh) on the lent GPU machine:
# unpacks the binary that scripts/gpu/build.sh wrote (target/gpu/stoker.xz) unless one is
# given or already unpacked, puts the libraries it loads on LD_LIBRARY_PATH (the CUDA
# libraries from NVIDIA's PyPI packages there, this machine's Debian libraries carried in
# target/gpu/libs.tar.xz, the driver's libcuda.so.1) and exports STOKER_GPU_BIN.
# Usage: source scripts/gpu/env.sh [BIN]   (from the repository root)
STOKER_GPU_BIN=${1:-${STOKER_GPU_BIN:-}}
if [ -z "$STOKER_GPU_BIN" ]; then
  [ -f target/gpu/stoker.xz ] || { echo "gpu env: no target/gpu/stoker.xz (bash scripts/gpu/build.sh)"; exit 1; }
  STOKER_GPU_BIN=${TMPDIR:-/tmp}/stoker-gpu
  if [ ! -x "$STOKER_GPU_BIN" ] || [ target/gpu/stoker.xz -nt "$STOKER_GPU_BIN" ]; then
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
      target/gpu/stoker.xz "$STOKER_GPU_BIN"
    chmod +x "$STOKER_GPU_BIN"
  fi
fi
[ -x "$STOKER_GPU_BIN" ] || { echo "gpu env: no binary at $STOKER_GPU_BIN"; exit 1; }
export STOKER_GPU_BIN
[ -f data/shakespeare/shakespeare.bin ] || { echo "gpu env: data/shakespeare is missing (carry it)"; exit 1; }
# The CUDA libraries candle links (cuBLAS, cuRAND, NVRTC) from NVIDIA's PyPI packages.
gpu_libs=$(python3 - <<'PY'
import glob, os, site
dirs = set()
for sp in site.getsitepackages() + [site.getusersitepackages()]:
    for so in glob.glob(os.path.join(sp, "nvidia", "**", "lib*.so*"), recursive=True):
        dirs.add(os.path.dirname(so))
print(":".join(sorted(dirs)))
PY
)
# This machine's Debian libraries the binary links (MPICH, UCX, libjpeg-turbo, ...).
if [ -f target/gpu/libs.tar.xz ]; then
  gpu_lib_dir=${TMPDIR:-/tmp}/stoker-gpu-lib
  mkdir -p "$gpu_lib_dir"
  python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' target/gpu/libs.tar.xz "$gpu_lib_dir"
  gpu_libs="$gpu_lib_dir${gpu_libs:+:$gpu_libs}"
fi
export LD_LIBRARY_PATH="$gpu_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# The driver's libcuda.so.1 where the loader's default paths miss it (a driver mounted
# into a container or microVM, e.g. /usr/local/nvidia/lib64).
if ldd "$STOKER_GPU_BIN" | grep -q 'libcuda.so.1 => not found'; then
  for d in $(ldconfig -p | awk '/libcuda\.so\.1 /{print $NF}' | xargs -r -n1 dirname) \
    /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/cuda/compat; do
    if [ -e "$d/libcuda.so.1" ]; then
      export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$d"
      break
    fi
  done
fi
if ldd "$STOKER_GPU_BIN" | grep 'not found'; then
  echo "gpu env: the libraries above are missing (LD_LIBRARY_PATH=$LD_LIBRARY_PATH)"
  exit 1
fi
