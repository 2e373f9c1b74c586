#!/usr/bin/env bash
# The training-step benchmark of issue #6, every ratio from the same run, 2 threads:
#   1. per-op forward+backward: fused vs composed (cargo bench ops), PyTorch (ops_torch.py);
#   2. bf16 GEMM: AMX / AVX512-BF16 / portable vs candle's f32 and bf16 matmuls;
#   3. the GPT training step, stoker fp32 and bf16 vs PyTorch eager fp32: the 822K-parameter
#      GPT (batch 16, context 128) and a 10.7M-parameter one (d 384, 6 layers, batch 8).
# Usage: bash scripts/bench/step.sh   (make bench-step)
set -euo pipefail
cd "$(dirname "$0")/../.."
export RAYON_NUM_THREADS=${THREADS:-2}
echo "== $(date -u +%FT%TZ) $(nproc) cores, RAYON_NUM_THREADS=$RAYON_NUM_THREADS"
echo "== per-op, fused vs composed (ms)"
cargo bench -q -p stoker-kernels --bench ops 2>/dev/null
echo "== per-op, PyTorch"
python3 scripts/bench/ops_torch.py
echo "== bf16 GEMM"
cargo bench -q -p stoker-kernels --bench matmul 2>/dev/null
echo "== GPT step, 822K parameters"
python3 scripts/bench/step.py --threads "$RAYON_NUM_THREADS" --steps 10
echo "== GPT step, 10.7M parameters"
python3 scripts/bench/step.py --threads "$RAYON_NUM_THREADS" --steps 5 \
    --d-model 384 --layers 6 --heads 6 --batch 8
