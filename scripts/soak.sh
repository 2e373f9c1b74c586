#!/usr/bin/env bash
# Kill-and-resume soak (issue #14, docs/reliability.md). A reference run trains for a third
# of the budget and is stopped by SIGTERM after step N; its weights are the target. Then a
# driver trains the same config to step N while killing it at random moments (SIGKILL or
# SIGTERM, 1-4 s apart) and restarting it with --resume latest each time, until a life
# reaches N. The soaked weights must equal the reference's bit for bit.
#
# Usage: bash scripts/soak.sh [MINUTES] [--generated]
#   MINUTES      the budget (default 10; make test runs 2)
#   --generated  a small GPT on a generated text (no downloads), else the Shakespeare GPT
#                of configs/shakespeare-gpt.toml on data/shakespeare (make data)
set -euo pipefail
cd "$(dirname "$0")/.."
MINUTES=${1:-10}
MODE=${2:-}
S=${STOKER:-target/release/stoker}
[ -x "$S" ] || cargo build --release -p stoker-cli >&2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
budget=$((MINUTES * 60))

if [ "$MODE" = "--generated" ]; then
  awk 'BEGIN { srand(7); split("the cat sat on a mat and the dog ran in fog we go to sea", w, " ");
               for (i = 0; i < 40000; i++) printf "%s ", w[int(rand() * 16) + 1] }' > "$work/text.txt"
  "$S" pack text "$work/corpus" "$work/text.txt" --tokenizer char > /dev/null
  cat > "$work/base.toml" <<TOML
seed = 3
precision = "fp32"
kernels = "direct"
[data]
train = "$work/corpus.bin"
eval_fraction = 0.1
[model]
kind = "gpt"
vocab = 32
context = 64
d_model = 64
n_layer = 2
n_head = 4
[batch]
micro_batch = 8
global_batch = 16
[optimizer]
kind = "adamw"
lr = 1e-3
[train]
steps = 100000
eval_every = 0
checkpoint_every = 5
log_every = 5
sample_tokens = 0
TOML
else
  [ -f data/shakespeare/shakespeare.bin ] || { echo "no Shakespeare shard: run make data first" >&2; exit 1; }
  sed -e '/^run_dir/d' -e 's/^steps = .*/steps = 100000/' -e 's/^eval_every = .*/eval_every = 0/' \
      -e 's/^checkpoint_every = .*/checkpoint_every = 5/' -e 's/^sample_tokens = .*/sample_tokens = 0/' \
      configs/shakespeare-gpt.toml > "$work/base.toml"
fi
{ echo "run_dir = \"$work/ref\""; cat "$work/base.toml"; } > "$work/ref.toml"
{ echo "run_dir = \"$work/soak\""; cat "$work/base.toml"; } > "$work/soak.toml"
export RAYON_NUM_THREADS=2

echo "== soak: reference run for $((budget / 3)) s, stopped by SIGTERM"
# One SIGTERM from here (GNU timeout would also signal the process group: a second
# signal, which ends a run at once).
"$S" train "$work/ref.toml" --no-progress > "$work/ref.log" 2>&1 &
pid=$!
sleep "$((budget / 3))"
kill -TERM "$pid"
set +e
wait "$pid"
code=$?
set -e
[ "$code" = 75 ] || { cat "$work/ref.log"; echo "error: the reference run ended with $code, expected 75 (preempted)" >&2; exit 1; }
steps=$(sed -n 's/^stopped by a signal after step \([0-9]*\):.*/\1/p' "$work/ref.log")
want=$(sed -n 's/^weights crc32: //p' "$work/ref.log")
echo "reference: step $steps, weights crc32 $want"

echo "== soak: to step $steps, killed at random moments"
lives=0 kills=0 terms=0 seed=11
deadline=$((SECONDS + budget * 2 / 3 + 60))
while :; do
  lives=$((lives + 1))
  resume=()
  [ -d "$work/soak/checkpoints" ] && resume=(--resume latest)
  "$S" train "$work/soak.toml" --no-progress --stop-after "$steps" "${resume[@]}" > "$work/life.log" 2>&1 &
  pid=$!
  seed=$(( (seed * 1103515245 + 12345) % 2147483648 ))
  nap=$((1000 + seed % 3000))
  sleep "$(printf '%d.%03d' $((nap / 1000)) $((nap % 1000)))"
  if kill -0 "$pid" 2>/dev/null; then
    if [ $((seed % 2)) = 0 ]; then kill -KILL "$pid"; kills=$((kills + 1)); else kill -TERM "$pid"; terms=$((terms + 1)); fi
  fi
  set +e
  { wait "$pid"; } 2>/dev/null
  code=$?
  set -e
  if [ "$code" = 0 ]; then break; fi
  case "$code" in
    75|137) ;;
    *) cat "$work/life.log"; echo "error: life $lives ended with status $code" >&2; exit 1 ;;
  esac
  [ "$SECONDS" -lt "$deadline" ] || { echo "error: the soak did not reach step $steps in time" >&2; exit 1; }
done
got=$(sed -n 's/^weights crc32: //p' "$work/life.log")
echo "soaked: $lives lives, $kills SIGKILL, $terms SIGTERM; weights crc32 $got"
if [ "$got" != "$want" ]; then
  echo "error: the soaked run's weights differ from the uninterrupted run's" >&2
  exit 1
fi
echo "soak: bit-identical to the uninterrupted run after $kills SIGKILL and $terms SIGTERM"
