#!/usr/bin/env bash
# The DDP step of issue #11 (make bench-ddp), on the Shakespeare token shard (make data):
#   1. step time at 1 rank x 1 thread vs 2 ranks x 1 thread at the same per-rank micro-batch
#      (so the difference is what data parallelism costs beyond compute), the exposed wait,
#      the same buckets' all-reduces alone, the overlap, and `stoker plan`'s prediction;
#      for the demo GPT (0.8M parameters, bf16) and a 10.7M-parameter one (fp32);
#   2. the chapter's 4.3.1 advice: 2 ranks, accumulation k = 2, 4, 8, 16, reducing only
#      the last micro-batch (the default, PyTorch's no_sync) vs every micro-batch.
# Every figure of one table comes from the same run. Usage: bash scripts/bench/ddp.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
S=target/release/stoker
DATA=data/shakespeare/shakespeare.bin
[ -f "$DATA" ] || { echo "no $DATA: run make data first" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# config NAME PRECISION D_MODEL LAYERS HEADS MICRO GLOBAL ACCUM SYNC_EVERY
config() {
  cat > "$work/$1.toml" <<TOML
run_dir = "$work/run-$1"
seed = 1
precision = "$2"
[data]
train = "$DATA"
eval_fraction = 0.1
[model]
kind = "gpt"
vocab = 96
context = 128
d_model = $3
n_layer = $4
n_head = $5
[batch]
micro_batch = $6
global_batch = $7
accumulation_steps = $8
[optimizer]
kind = "adamw"
lr = 1e-3
[train]
steps = 1
[parallel]
sync_every_micro_batch = $9
threads_per_rank = 1
TOML
  echo "$work/$1.toml"
}
echo "== $(date -u +%FT%TZ) $(nproc) cores; $(mpirun --version | sed -n 2p | xargs)"
for spec in "demo bf16 128 4 4 16 20" "10.7M fp32 384 6 6 8 8"; do
  set -- $spec
  echo "== DDP step, GPT $1 ($2), micro-batch $6 per rank, $7 steps timed"
  one=$(config "$1-1" "$2" "$3" "$4" "$5" "$6" "$6" 1 false)
  two=$(config "$1-2" "$2" "$3" "$4" "$5" "$6" $(( $6 * 2 )) 1 false)
  RAYON_NUM_THREADS=1 "$S" bench ddp "$one" --steps "$7" --json "$work/one.json"
  timeout 900 mpirun -n 2 "$S" bench ddp "$two" --steps "$7" --json "$work/two.json"
  python3 - "$work/one.json" "$work/two.json" <<'PY'
import json, sys
one, two = (json.load(open(p)) for p in sys.argv[1:])
extra = two["step_ms"] - one["step_ms"]
print(f"step: 1 rank {one['step_ms']:.1f} ms, 2 ranks {two['step_ms']:.1f} ms: "
      f"{extra:+.1f} ms beyond compute ({two['step_ms'] / one['step_ms']:.3f}x); "
      f"communication alone {two['isolated_comm_ms']:.2f} ms, exposed {two['exposed_wait_ms']:.2f} ms, "
      f"overlap {100 * two['overlap']:.0f}%; plan predicts {two['plan_comm_ms']:.2f} ms "
      f"(measured / plan {two['isolated_comm_ms'] / two['plan_comm_ms']:.2f}); "
      f"2-rank throughput {2 * one['step_ms'] / two['step_ms']:.2f}x one rank's")
PY
done
echo "== sync timing (4.3.1): 2 ranks, demo GPT (bf16), micro-batch 8, global batch 2 x 8 x k"
for k in 2 4 8 16; do
  for every in false true; do
    c=$(config "k$k-$every" bf16 128 4 4 8 $(( 16 * k )) "$k" "$every")
    timeout 900 mpirun -n 2 "$S" bench ddp "$c" --steps 8 --warmup 2 --json "$work/k.json"
    python3 -c "import json; r = json.load(open('$work/k.json')); print(f'k = $k, sync every micro-batch = $every: step {r[\"step_ms\"]:.1f} ms, exposed wait {r[\"exposed_wait_ms\"]:.2f} ms, {r[\"mib_sent_per_step\"]:.2f} MiB sent per step')"
  done
done
