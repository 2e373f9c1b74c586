#!/usr/bin/env bash
# "N ranks give what 1 rank gives", on the GPU: the demo's data-parallel GPT
# (configs/shakespeare-gpt-ddp.toml: global batch 16 in micro-batches of 8, deterministic
# mode) trained STEPS steps on 1 rank (2 micro-batches accumulated) and on 2 ranks as
# threads of one process (`backend = "local"`, 1 micro-batch each) under DDP, ZeRO-1 and
# ZeRO-2, every model on the same GPU (`device = "cuda:0"`, the optimizer offloaded to the
# host), in fp32 and bf16. Deterministic mode fixes the reduction tree on the host, so the
# weights must be bit-identical (the runs' "weights crc32"), as on a CPU. ZeRO-3 (refused
# in deterministic mode) is held to the 1-rank losses within a tolerance (fp32 1e-4
# relative, bf16 2e-2). Each run ends with an evaluation (ZeRO-3's unit by unit): the same
# loss where the weights are the same, within the tolerance for ZeRO-3. Exits 1 on any
# difference or failed run.
#   bash scripts/gpu/ranks-check.sh [BIN]     (DEVICE=cpu with a CPU build: the same check
#   on the host, kernels = "composed"; STEPS, default 30)
set -euo pipefail
cd "$(dirname "$0")/../.."
steps=${STEPS:-30}
dev=${DEVICE:-cuda:0}
out=${OUT:-/tmp}/ranks-check
rm -rf "$out" && mkdir -p "$out"
source scripts/gpu/env.sh "${1:-}"

# config NAME PRECISION WORLD STRATEGY DETERMINISTIC
config() {
  local f=$out/$1.toml
  sed -e "s|^run_dir = .*|run_dir = \"$out/$1\"|" \
      -e "s|^precision = .*|precision = \"$2\"\nkernels = \"composed\"\ndevice = \"$dev\"|" \
      -e "s|^micro_batch = .*|micro_batch = 8\nworld_size = $3|" \
      -e "s|^log_every = .*|log_every = 1|" \
      -e "s|^checkpoint_every = .*|checkpoint_every = 100000|" \
      -e "s|^eval_every = .*|eval_every = $steps|" \
      -e "s|^eval_batches = .*|eval_batches = 4|" \
      -e "s|^num_workers = .*|num_workers = 0|" \
      -e "s|^persistent_workers = .*|persistent_workers = false|" \
      -e "s|^deterministic = .*|deterministic = $5\nstrategy = \"$4\"\nbackend = \"local\"|" \
      configs/shakespeare-gpt-ddp.toml > "$f"
  [ "$dev" = cpu ] || echo "offload_optimizer = true" >> "$f"
  echo "$f"
}

status=0
crc() { sed -n 's/^weights crc32: //p' "$out/$1.log"; }
evl() { grep -m1 -o '^eval loss [0-9.]*' "$out/$1.log" || echo "NO EVALUATION"; }
for prec in fp32 bf16; do
  runs=("$prec-1rank $prec 1 ddp true" "$prec-ddp $prec 2 ddp true" "$prec-zero1 $prec 2 zero1 true"
        "$prec-zero2 $prec 2 zero2 true" "$prec-zero3 $prec 2 zero3 false")
  for r in "${runs[@]}"; do
    set -- $r
    f=$(config "$@")
    if ! timeout 180 "$STOKER_GPU_BIN" train "$f" --stop-after "$steps" --no-progress > "$out/$1.log" 2>&1; then
      echo "FAILED $1 ($out/$1.log):"; tail -15 "$out/$1.log"; status=1
    fi
  done
  ref=$(crc "$prec-1rank")
  echo "$prec: 1 rank, weights crc32 ${ref:-none} after $steps steps, $(evl "$prec-1rank") ($(grep -m1 '^throughput' "$out/$prec-1rank.log" || true))"
  for s in ddp zero1 zero2; do
    got=$(crc "$prec-$s")
    if [ -n "$ref" ] && [ "$got" = "$ref" ]; then verdict="bit-identical"; else verdict="DIFFERENT"; status=1; fi
    [ "$(evl "$prec-$s")" = "$(evl "$prec-1rank")" ] || { verdict="$verdict, EVALUATION DIFFERS"; status=1; }
    echo "$prec: 2 ranks $s, weights crc32 ${got:-none}: $verdict, $(evl "$prec-$s") ($(grep -m1 '^throughput' "$out/$prec-$s.log" || true))"
  done
  python3 - "$out/$prec-1rank/metrics.jsonl" "$out/$prec-zero3/metrics.jsonl" "$prec" <<'PY' || status=1
import json, math, sys
def losses(p):
    try:
        return {r["step"]: r["loss"] for r in map(json.loads, open(p)) if r.get("kind") == "train"}
    except OSError as e:
        sys.exit(f"  no metrics: {e}")
a, b, prec = losses(sys.argv[1]), losses(sys.argv[2]), sys.argv[3]
tol = {"fp32": 1e-4, "bf16": 2e-2}[prec]
common = sorted(set(a) & set(b))
if not common:
    sys.exit(f"{prec}: 2 ranks zero3: no step in both runs FAILED")
worst = max(abs(b[s] - a[s]) / abs(a[s]) for s in common)
ok = all(math.isfinite(a[s]) and math.isfinite(b[s]) for s in common) and worst <= tol
def evals(p):
    return [r["loss"] for r in map(json.loads, open(p)) if r.get("kind") == "eval"]
ea, eb = evals(sys.argv[1]), evals(sys.argv[2])
ok = ok and len(ea) == len(eb) == 1 and abs(eb[0] - ea[0]) <= tol * abs(ea[0])
print(f"{prec}: 2 ranks zero3 vs 1 rank: evaluation loss {eb} vs {ea}")
print(f"{prec}: 2 ranks zero3 vs 1 rank: {len(common)} steps, worst relative loss difference "
      f"{worst:.2e} (tolerance {tol:.0e}) {'OK' if ok else 'FAILED'}")
sys.exit(0 if ok else 1)
PY
done
[ $status = 0 ] && echo "ranks check: PASSED" || echo "ranks check: FAILED"
exit $status
