#!/usr/bin/env bash
# Installs torch and transformers (pinned) into a cache outside the checkout, for the
# Hugging Face interop test (crates/stoker-train/tests/hf.rs), and prints its path.
# torch's Linux wheel from PyPI pulls its CUDA libraries (about 4 GB) even for CPU use,
# so `make test` does not install it (the test says SKIPPED); `make test-hf` does.
set -euo pipefail
TORCH=2.15.0
TRANSFORMERS=4.57.1
cache="${STOKER_CACHE_DIR:-$HOME/.cache/stoker}/hf-torch-$TORCH-transformers-$TRANSFORMERS"
if PYTHONPATH="$cache" python3 -c 'import torch, transformers' 2>/dev/null; then
  echo "$cache"
  exit 0
fi
mkdir -p "$(dirname "$cache")"
rm -rf "$cache.tmp"
echo "installing torch $TORCH and transformers $TRANSFORMERS into $cache (about 4 GB)" >&2
python3 -m pip install -q --target "$cache.tmp" "torch==$TORCH" "transformers==$TRANSFORMERS" numpy >&2
rm -rf "$cache"
mv "$cache.tmp" "$cache"
echo "$cache"
