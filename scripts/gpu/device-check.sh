#!/usr/bin/env bash
# Everything a session with a lent GPU checks, as one device call (the device tool's time
# is short: one prepared script, rerun at most once). Run in the repository root there,
# carrying target/gpu (bash scripts/gpu/build.sh) and data/shakespeare:
#   bash scripts/gpu/device-check.sh [PART...]      (default: all five, in this order)
# - kernels: scripts/gpu/kernels-check.sh, stoker's own GPU kernels (crates/stoker-gpu)
#   against their host build bit for bit, and each one's time at GPT-2 124M's shapes
#   beside PyTorch's for the same operation;
# - resident: scripts/gpu/resident-check.sh, the trainer on the resident GPU loop (the
#   demo's GPT, 1 and 2 ranks) against the CPU direct step, losses and norms per step;
# - offload: scripts/gpu/offload-check.sh, the demo's GPT on the CPU and on the GPU
#   (optimizer offloaded to the host), fp32 and bf16, losses compared step by step;
# - ranks: scripts/gpu/ranks-check.sh, 1 rank vs 2 ranks (DDP, ZeRO-1/2 bit for bit,
#   ZeRO-3 within a tolerance) with every model on the GPU;
# - step-time: scripts/gpu/step-time.sh, stoker (candle's graph, and the resident step) vs
#   PyTorch on the GPU, two GPT sizes.
# The log and the runs' logs, configs and metrics come back in $OUT (device-check.log,
# runs.tar.gz). Exits 1 if a part fails.
set -uo pipefail
cd "$(dirname "$0")/../.."
res=${OUT:-/tmp/gpu-out}
work=${TMPDIR:-/tmp}/gpu-check
mkdir -p "$res"
parts=("$@")
[ ${#parts[@]} = 0 ] && parts=(kernels resident step-time offload ranks)
status=0
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
  echo "cpu cores: $(nproc)"
  for part in "${parts[@]}"; do
    case $part in
      kernels) script=kernels-check.sh ;;
      resident) script=resident-check.sh ;;
      offload) script=offload-check.sh ;;
      ranks) script=ranks-check.sh ;;
      step-time) script=step-time.sh ;;
      *) echo "device-check: unknown part $part (kernels, resident, step-time, offload, ranks)"; echo "$part exit 2"; continue ;;
    esac
    OUT=$work timeout 600 bash "scripts/gpu/$script"
    echo "$part exit $?"
  done
} 2>&1 | tee "$res/device-check.log"
grep -E '^[a-z-]+ exit [1-9]' "$res/device-check.log" && status=1
(cd "$work" && find . \( -name '*.log' -o -name '*.toml' -o -name 'metrics.jsonl' \) -print0 |
  tar --null -czf "$res/runs.tar.gz" -T -) || true
exit $status
