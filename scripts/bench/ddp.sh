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
  echo "== DDP step, GPT $1 ($2), micro-batch $6 per rank, $7 steps timed; 1 and 2 ranks alternate, two rounds"
  one=$(config "$1-1" "$2" "$3" "$4" "$5" "$6" "$6" 1 false)
  two=$(config "$1-2" "$2" "$3" "$4" "$5" "$6" $(( $6 * 2 )) 1 false)
  for round in 1 2; do
    RAYON_NUM_THREADS=1 "$S" bench ddp "$one" --steps "$7" --json "$work/one-$round.json"
    timeout 900 mpirun -n 2 "$S" bench ddp "$two" --steps "$7" --json "$work/two-$round.json"
  done
  python3 - "$work" <<'PY'
import json, sys
w = sys.argv[1]
def mean(kind, key):
    v = [json.load(open(f"{w}/{kind}-{r}.json"))[key] for r in (1, 2)]
    return sum(v) / len(v)
one, two = mean("one", "step_ms"), mean("two", "step_ms")
iso, exp, plan = mean("two", "isolated_comm_ms"), mean("two", "exposed_wait_ms"), mean("two", "plan_comm_ms")
ov = max(0.0, min(1.0, (iso - exp) / iso)) if iso > 0 else float("nan")
print(f"step: 1 rank {one:.1f} ms, 2 ranks {two:.1f} ms: {two - one:+.1f} ms beyond compute ({two / one:.3f}x); "
      f"communication alone {iso:.2f} ms, exposed {exp:.2f} ms, overlap {100 * ov:.0f}%; plan predicts {plan:.2f} ms "
      f"(measured / plan {iso / plan:.2f}); 2-rank throughput {2 * one / two:.2f}x one rank's")
PY
done
echo "== sync timing (4.3.1): 2 ranks, GPT 10.7M (fp32), micro-batch 2 per rank, global batch 2 x 2 x k;"
echo "   reduce only the last micro-batch (no_sync, the default) vs every micro-batch; two alternating rounds each"
for k in 2 4 8 16; do
  for round in 1 2; do
    for every in false true; do
      c=$(config "k$k-$every" fp32 384 6 6 2 $(( 4 * k )) "$k" "$every")
      timeout 900 mpirun -n 2 "$S" bench ddp "$c" --steps 5 --warmup 1 --json "$work/k$k-$every-$round.json" >/dev/null
    done
  done
  python3 - "$work" "$k" <<'PY'
import json, sys
work, k = sys.argv[1], sys.argv[2]
r = {e: [json.load(open(f"{work}/k{k}-{e}-{i}.json")) for i in (1, 2)] for e in ("false", "true")}
step = {e: sum(x["step_ms"] for x in v) / 2 for e, v in r.items()}
wait = {e: sum(x["exposed_wait_ms"] for x in v) / 2 for e, v in r.items()}
mib = {e: v[0]["mib_sent_per_step"] for e, v in r.items()}
print(f"k = {k:>2}: last micro-batch only {step['false']:8.1f} ms/step ({wait['false']:6.1f} ms waiting, {mib['false']:6.1f} MiB sent); "
      f"every micro-batch {step['true']:8.1f} ms/step ({wait['true']:6.1f} ms waiting, {mib['true']:6.1f} MiB sent): "
      f"every / last = {step['true'] / step['false']:.3f}")
PY
done
