#!/usr/bin/env bash
# Installs what stoker's build, tests and demos need on a fresh Debian machine (as root).
set -euo pipefail
need_apt=()
for pkg in build-essential pkg-config python3-pip npm; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
# Tools may come from outside Debian (the machine's own python/npm): only install what is missing.
if ((${#need_apt[@]})); then
  filtered=()
  for pkg in "${need_apt[@]}"; do
    case "$pkg" in
      python3-pip) command -v pip3 >/dev/null || command -v pip >/dev/null || filtered+=("$pkg") ;;
      npm) command -v npm >/dev/null || filtered+=("$pkg") ;;
      *) filtered+=("$pkg") ;;
    esac
  done
  if ((${#filtered[@]})); then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${filtered[@]}"
  fi
fi
command -v cargo >/dev/null || { echo "error: cargo not found; install a Rust toolchain (1.85 or newer) first" >&2; exit 1; }
# numpy writes the .npy fixtures the tests read back; ml_dtypes is the FP8 reference.
python3 -c 'import numpy, ml_dtypes' 2>/dev/null || python3 -m pip install -q numpy ml_dtypes
