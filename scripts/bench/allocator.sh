#!/usr/bin/env bash
# The binary's allocator: glibc's malloc kept from returning freed memory (the default,
# stoker_train::malloc_tuning) against mimalloc 2 (`--features mimalloc`, what the binary
# used before), on the same configs in the same run, alternating binaries. Per run: the
# training steps' peak RSS over the forecast (measured/planned) and the step time; then
# each config's step time with glibc over mimalloc (median of the rounds).
# Configs: the demo's GPT on the direct step (bf16, fp32), on candle's graph (fp32,
# kernels = "fused"), the issue's GPT (d 320, 5 layers, context 192, batch 12) on the graph,
# the MNIST CNN, and the ZeRO config's 8-block GPT on the graph under DDP and ZeRO-3 on
# 2 MPI ranks. 0 loader workers; each config calibrated once (`stoker plan --calibrate`).
# Usage: bash scripts/bench/allocator.sh   (ROUNDS=2, STEPS=40)
set -euo pipefail
cd "$(dirname "$0")/../.."
# Plans from each config's own calibration, written into it; no machine profile is read or
# written (`stoker plan --calibrate` would record the steps in the user's).
export STOKER_PROFILE=off
[ -f data/shakespeare/shakespeare.bin ] && [ -f data/mnist/train.image.npy ] \
  || { echo "no Shakespeare shard or MNIST: run make data first" >&2; exit 1; }
ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-40}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# mimalloc first, so that target/release/stoker ends as the default build.
cargo build -q --release -p stoker-cli --features mimalloc
cp target/release/stoker "$work/stoker-mimalloc"
cargo build -q --release -p stoker-cli
cp target/release/stoker "$work/stoker-glibc"

gpt() { # NAME D_MODEL LAYERS HEADS CONTEXT MICRO PRECISION KERNELS
  sed -e "s/^d_model = .*/d_model = $2/" -e "s/^n_layer = .*/n_layer = $3/" -e "s/^n_head = .*/n_head = $4/" \
      -e "s/^context = .*/context = $5/" -e "s/^micro_batch = .*/micro_batch = $6/" \
      -e "s/^global_batch = .*/global_batch = $6/" -e "s/^precision = .*/precision = \"$7\"\nkernels = \"$8\"/" \
      -e "s/^num_workers = .*/num_workers = 0/" -e "s/^persistent_workers = .*/persistent_workers = false/" \
      -e "s#^run_dir = .*#run_dir = \"$work/run-$1\"#" configs/shakespeare-gpt.toml > "$work/$1.in.toml"
  "$work/stoker-glibc" plan --config "$work/$1.in.toml" --calibrate --emit-config "$work/$1.toml" > /dev/null
}
mpi_gpt() { # NAME STRATEGY
  sed -e "s/^precision = .*/precision = \"fp32\"\nkernels = \"fused\"/" -e "s/^strategy = .*/strategy = \"$2\"/" \
      -e "s/^num_workers = .*/num_workers = 0/" -e "s/^persistent_workers = .*/persistent_workers = false/" \
      -e "s#^run_dir = .*#run_dir = \"$work/run-$1\"#" configs/shakespeare-gpt-zero.toml > "$work/$1.in.toml"
  "$work/stoker-glibc" plan --config "$work/$1.in.toml" --calibrate --devices-per-node 2 \
    --emit-config "$work/$1.toml" > /dev/null
  sed -i "s/^strategy = .*/strategy = \"$2\"/" "$work/$1.toml"
}
gpt demo-bf16 128 4 4 128 16 bf16 direct
gpt demo-fp32 128 4 4 128 16 fp32 direct
gpt demo-graph 128 4 4 128 16 fp32 fused
gpt issue-graph 320 5 5 192 12 fp32 fused
sed -e "s#^run_dir = .*#run_dir = \"$work/run-cnn\"#" -e "s/^num_workers = .*/num_workers = 0/" \
    -e "s/^persistent_workers = .*/persistent_workers = false/" configs/mnist-cnn.toml > "$work/cnn.toml"
mpi_gpt ddp-graph-2ranks ddp
mpi_gpt zero3-graph-2ranks zero3
configs="demo-bf16 demo-fp32 demo-graph issue-graph cnn ddp-graph-2ranks zero3-graph-2ranks"

field() { grep -E '^planned vs' "$1" | grep -oE "$2" | grep -oE '[0-9.]+' | tail -1; }
echo "| round | config | allocator | peak RSS (MiB) | peak RSS / forecast | step (ms) |"
echo "|---|---|---|---|---|---|"
for round in $(seq "$ROUNDS"); do
  for c in $configs; do
    for a in glibc mimalloc; do
      rm -rf "$work/run-$c"
      log="$work/$c.$a.$round.log"
      case $c in
        *2ranks) timeout 900 mpirun -n 2 "$work/stoker-$a" train "$work/$c.toml" --no-progress --stop-after 30 > "$log" 2>&1 ;;
        *) RAYON_NUM_THREADS=2 "$work/stoker-$a" train "$work/$c.toml" --no-progress --stop-after "$STEPS" > "$log" 2>&1 ;;
      esac
      rss=$(field "$log" 'measured peak RSS [0-9.]+ MiB')
      ratio=$(field "$log" 'measured peak RSS [0-9.]+ MiB \(measured/planned [0-9.]+')
      step=$(field "$log" 'measured [0-9.]+ ms')
      echo "$step" >> "$work/$c.$a.steps"
      echo "| $round | $c | $a | $rss | $ratio | $step |"
    done
  done
done
echo
echo "| config | step glibc / mimalloc (median of $ROUNDS rounds) |"
echo "|---|---|"
for c in $configs; do
  python3 - "$work/$c.glibc.steps" "$work/$c.mimalloc.steps" "$c" <<'EOF'
import statistics, sys
g = statistics.median(float(x) for x in open(sys.argv[1]))
m = statistics.median(float(x) for x in open(sys.argv[2]))
print(f"| {sys.argv[3]} | {g:.1f} / {m:.1f} ms = {g / m:.2f} |")
EOF
done
