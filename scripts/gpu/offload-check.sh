#!/usr/bin/env bash
# The GPU offload check (docs/zero.md, "Offload"), for a session with a lent GPU (first
# run 2026-12-04 on an H200: passed). It trains the demo's GPT for STEPS steps four times
# with the same seed and data order, fp32 and bf16 each on the CPU (kernels = "composed",
# the same candle maths) and on the GPU (device = "cuda", the optimizer offloaded to the
# host), and compares the per-step losses: GPU and CPU sum in different orders, so they
# agree to a tolerance, not bit for bit (fp32 within 2e-3 relative, bf16 within 3e-2, over
# 40 steps). It prints each run's median step time and the GPU/CPU ratio, and exits 1 if
# a loss is off or not finite, or a run fails. Four runs of at most 120 s each.
#
# Here (no GPU needed): `bash scripts/gpu/build.sh` writes target/gpu/stoker.xz (candle's
# kernels compiled by nvcc 13.0 for Hopper); then, through the device tool, run this script
# in the repository root carrying target/gpu and data/shakespeare (about 27 MB together):
#   bash scripts/gpu/offload-check.sh [BIN]
set -euo pipefail
cd "$(dirname "$0")/../.."
steps=${STEPS:-40}
out=${OUT:-/tmp}/offload-check
rm -rf "$out" && mkdir -p "$out"
source scripts/gpu/env.sh "${1:-}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

# config DEVICE PRECISION: the demo's GPT, logging every step, no checkpoint or sample.
config() {
  local dev=$1 prec=$2 f=$out/$1-$2.toml
  sed -e "s|^run_dir = .*|run_dir = \"$out/$dev-$prec\"|" \
      -e "s|^precision = .*|precision = \"$prec\"\nkernels = \"composed\"\ndevice = \"$dev\"|" \
      -e "s|^log_every = .*|log_every = 1|" \
      -e "s|^checkpoint_every = .*|checkpoint_every = 100000|" \
      -e "s|^eval_every = .*|eval_every = 100000|" \
      -e "s|^sample_tokens = .*|sample_tokens = 0|" \
      -e "s|^num_workers = .*|num_workers = 0|" \
      -e "s|^persistent_workers = .*|persistent_workers = false|" \
      configs/shakespeare-gpt.toml > "$f"
  [ "$dev" = cuda ] && printf '\n[parallel]\noffload_optimizer = true\n' >> "$f"
  echo "$f"
}

status=0
for prec in fp32 bf16; do
  for dev in cpu cuda; do
    f=$(config $dev $prec)
    echo "== $dev $prec: $STOKER_GPU_BIN train $f --stop-after $steps"
    if ! timeout 120 "$STOKER_GPU_BIN" train "$f" --stop-after "$steps" --no-progress > "$out/$dev-$prec.log" 2>&1; then
      echo "FAILED ($out/$dev-$prec.log):"; tail -20 "$out/$dev-$prec.log"; status=1
    fi
  done
  python3 - "$out/cpu-$prec/metrics.jsonl" "$out/cuda-$prec/metrics.jsonl" "$prec" <<'EOF' || status=1
import json, math, statistics, sys
def steps(path):
    try:
        rows = [json.loads(l) for l in open(path)]
    except OSError as e:
        sys.exit(f"  no metrics: {e}")
    return {r["step"]: r for r in rows if r.get("kind") == "train"}
cpu, gpu, prec = steps(sys.argv[1]), steps(sys.argv[2]), sys.argv[3]
tol = {"fp32": 2e-3, "bf16": 3e-2}[prec]
common = sorted(set(cpu) & set(gpu))
if not common:
    sys.exit("  no step in both runs")
worst = max(abs(gpu[s]["loss"] - cpu[s]["loss"]) / abs(cpu[s]["loss"]) for s in common)
t_cpu = statistics.median(cpu[s]["step_s"] for s in common[2:] or common)
t_gpu = statistics.median(gpu[s]["step_s"] for s in common[2:] or common)
finite = all(math.isfinite(r[s]["loss"]) for r in (cpu, gpu) for s in common)
ok = finite and worst <= tol
print(f"  {prec}: {len(common)} steps, loss at step {common[-1]}: cpu {cpu[common[-1]]['loss']:.5f} "
      f"gpu {gpu[common[-1]]['loss']:.5f}; worst relative difference {worst:.2e} (tolerance {tol:.0e}) "
      f"{'OK' if ok else 'FAILED'}")
print(f"  {prec}: median step cpu {t_cpu*1e3:.1f} ms, gpu (offloaded optimizer) {t_gpu*1e3:.1f} ms, "
      f"gpu/cpu {t_gpu/t_cpu:.3f}")
sys.exit(0 if ok else 1)
EOF
done
[ $status = 0 ] && echo "offload check: PASSED" || echo "offload check: FAILED"
exit $status
