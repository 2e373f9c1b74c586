#!/usr/bin/env bash
# The main job (make demo): the data pipeline on real data, then a char-level GPT trained on
# Shakespeare in bf16, a text sample, and the report plots.
set -euo pipefail
cd "$(dirname "$0")/.."
STOKER=target/release/stoker
echo "== loader on MNIST (60,000 x 1x28x28 u8), shuffled, batch 256 =="
"$STOKER" bench loader data/mnist/train --batch 256 --seconds 2 --workers 0,1,2
echo
echo "== loader autotune on the Shakespeare token shard (context 128, batch 16) =="
"$STOKER" tune loader data/shakespeare/shakespeare.bin --batch 16 --context 128 --seconds 1 --max-workers 8
echo
echo "== plan: the chapter's decision flow for this run on this machine =="
"$STOKER" plan --model stoker-gpt --hardware cpu --global-batch 16 --seq-len 128 | sed -n '/Decision path/,/^$/p'
echo
echo "== train: char-level GPT (~0.8M parameters, bf16) on Shakespeare =="
RAYON_NUM_THREADS=2 "$STOKER" train configs/shakespeare-gpt.toml
"$STOKER" report runs/shakespeare
echo "plots: runs/shakespeare/*.png"
