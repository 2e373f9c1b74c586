#!/usr/bin/env bash
# stoker's GPU kernels (crates/stoker-gpu) on the lent GPU: every kernel against the host
# build of the same source, bit for bit (`stoker bench gpu-kernels` exits 1 on any
# difference), then each kernel's median time at GPT-2 124M's shapes (bf16, micro-batch
# BATCH x 1024) beside PyTorch's time for the same operation on the same GPU
# (scripts/gpu/torch_kernels.py, eager: compiling each op would take minutes of the
# device call; TORCH_KERNELS_COMPILE=1 adds torch.compile's times); then the GPT
# step on the GPU against the host backend, and GPT-2 124M's bf16 forward + backward timed
# beside PyTorch's (scripts/gpu/torch_gpt2.py: compile, SDPA, bf16 autocast); with flash
# attention also at twice and four times the micro-batch (PyTorch at twice: the issue's
# figure is at the largest micro-batch that fits), with the
# forecast's efficiencies fitted to each timed step (gpu-efficiencies.toml).
#   bash scripts/gpu/kernels-check.sh [BIN]      (BATCH, default 16; REPS, default 20)
# The three parts' limits add up to 560 s, inside one 600 s device call.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/gpu/env.sh "${1:-}"
batch=${BATCH:-16}
reps=${REPS:-20}
status=0
# The forecast's efficiencies fitted to each timed GPT-2 step go to a TOML file that the
# device check brings back (runs.tar.gz): a GPU's row for crates/stoker-gpu/src/measured.rs.
mkdir -p "${OUT:-/tmp}"
timeout 280 "$STOKER_GPU_BIN" bench gpu-kernels --step --batch "$batch" --reps "$reps" \
  --fit-out "${OUT:-/tmp}/gpu-efficiencies.toml" || status=1
echo
# The whole step's baseline (the issue's figure) before the per-kernel one.
timeout 180 python3 -u scripts/gpu/torch_gpt2.py --batch "$batch" --batch $((2 * batch)) --steps "$reps" || status=1
echo
compile=--no-compile
[ "${TORCH_KERNELS_COMPILE:-0}" = 1 ] && compile=
timeout 100 python3 -u scripts/gpu/torch_kernels.py --batch "$batch" --reps "$reps" $compile || status=1
exit $status
