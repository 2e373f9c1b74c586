#!/usr/bin/env bash
# The main job (make demo): the data pipeline on real data, then training.
set -euo pipefail
cd "$(dirname "$0")/.."
STOKER=target/release/stoker
echo "== loader on MNIST (60,000 x 1x28x28 u8), shuffled, batch 256 =="
"$STOKER" bench loader data/mnist/train --batch 256 --seconds 2 --workers 0,1,2
echo
echo "== loader autotune on the Shakespeare token shard (context 256, batch 64) =="
"$STOKER" tune loader data/shakespeare/shakespeare.bin --batch 64 --context 256 --seconds 1 --max-workers 8
