#!/usr/bin/env bash
# Installs torch and transformers (pinned) into caches outside the checkout, for the
# Hugging Face interop test (crates/stoker-train/tests/hf.rs), and prints the PYTHONPATH
# that holds both. torch's Linux wheel from PyPI pulls its CUDA libraries (about 4 GB)
# even for CPU use, so `make test` does not install it (the test says SKIPPED);
# `make test-hf` does. One torch serves every transformers version:
#
#   scripts/install-hf.sh [TRANSFORMERS_VERSION]   (default: the 4.x pin)
set -euo pipefail
TORCH=2.15.0
TRANSFORMERS=${1:-4.57.1}
root="${STOKER_CACHE_DIR:-$HOME/.cache/stoker}"
torch_dir="$root/hf-torch-$TORCH"
tf_dir="$root/hf-transformers-$TRANSFORMERS"
install() { # install DIR CHECK PIP-ARGS...
  local dir=$1 check=$2
  shift 2
  if PYTHONPATH="$dir" python3 -c "$check" 2>/dev/null; then return 0; fi
  mkdir -p "$(dirname "$dir")"
  rm -rf "$dir.tmp"
  echo "installing $* into $dir" >&2
  python3 -m pip install -q --target "$dir.tmp" "$@" >&2
  rm -rf "$dir"
  mv "$dir.tmp" "$dir"
}
install "$torch_dir" 'import torch, numpy' "torch==$TORCH" numpy
# transformers and its own dependencies (tokenizers, safetensors, huggingface-hub, ...):
# torch is only an extra of transformers, so this does not pull a second one.
install "$tf_dir" 'import transformers' "transformers==$TRANSFORMERS"
echo "$tf_dir:$torch_dir"
