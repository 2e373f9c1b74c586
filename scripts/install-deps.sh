#!/usr/bin/env bash
# Installs what stoker's build, tests, demos and benchmarks need on a fresh Debian machine (root).
# libturbojpeg0-dev: the JPEG pipeline links the system libjpeg-turbo (TurboJPEG API >= 2.0) via pkg-config.
set -euo pipefail
want=(build-essential pkg-config unzip ca-certificates fonts-dejavu-core libturbojpeg0-dev)
command -v python3 >/dev/null || want+=(python3 python3-pip)
command -v npm >/dev/null || want+=(npm)
missing=()
for pkg in "${want[@]}"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
if ((${#missing[@]})); then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
command -v cargo >/dev/null || { echo "error: cargo not found: stoker needs a Rust toolchain (1.85 or newer)" >&2; exit 1; }
# numpy writes the .npy fixtures and ml_dtypes is the FP8 reference; both only for checks.
python3 -c 'import numpy, ml_dtypes' 2>/dev/null || python3 -m pip install -q numpy ml_dtypes 2>&1 | grep -v WARNING || true
