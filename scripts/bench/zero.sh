#!/usr/bin/env bash
# Per-rank model-state bytes and bytes sent per step, held vs planned (issue #12), for
# DDP, ZeRO-1, ZeRO-2 and ZeRO-3 at 1, 2 and 4 ranks (mpirun), with step time and eval
# loss: configs/shakespeare-gpt-zero.toml (8 blocks, 1.6M parameters, bf16), 20 steps
# each, and the heap the run counted against its forecast. Prints one table row per run
# (rank 0's figures). Usage: bash scripts/bench/zero.sh; KERNELS=fused PRECISION=fp32
# bash scripts/bench/zero.sh runs the candle-graph path instead (ZeRO-3 unit by unit).
set -euo pipefail
cd "$(dirname "$0")/../.."
S=target/release/stoker
[ -f data/shakespeare/shakespeare.bin ] || { echo "no Shakespeare shard: run make data first" >&2; exit 1; }
STEPS=${STEPS:-20}
KERNELS=${KERNELS:-direct}
PRECISION=${PRECISION:-bf16}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
printf '| strategy | ranks | model states planned (MiB) | held (MiB) | held/planned | workspace (MiB) | sent/step planned (MiB) | counted (MiB) | counted/planned | step (ms) | eval loss | heap counted/planned |\n'
printf '|---|---|---|---|---|---|---|---|---|---|---|---|\n'
for strategy in ddp zero1 zero2 zero3; do
  for ranks in 1 2 4; do
    name="$strategy-$ranks"
    sed -e "s#^run_dir = .*#run_dir = \"$work/$name\"#" \
        -e "s#^strategy = .*#strategy = \"$strategy\"#" \
        -e "s#^steps = .*#steps = $STEPS#" \
        -e "s#^eval_every = .*#eval_every = $STEPS#" \
        -e "s#^checkpoint_every = .*#checkpoint_every = 0#" \
        -e "s#^precision = .*#precision = \"$PRECISION\"\nkernels = \"$KERNELS\"#" \
        configs/shakespeare-gpt-zero.toml > "$work/$name.toml"
    if [ "$ranks" = 1 ]; then
      RAYON_NUM_THREADS=2 "$S" train "$work/$name.toml" --no-progress > "$work/$name.log" 2>&1
    else
      timeout 900 mpirun -n "$ranks" "$S" train "$work/$name.toml" --no-progress > "$work/$name.log" 2>&1
    fi
    python3 - "$work/$name.log" "$strategy" "$ranks" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
def grab(pattern, default="-"):
    m = re.search(pattern, text)
    return m.groups() if m else None
ms = grab(r"model states per rank \([^)]*\): planned ([\d.]+) MiB .*?held ([\d.]+) MiB .*?held/planned ([\d.]+); workspace ([\d.]+) MiB")
sent = grab(r"bytes sent per step per rank: planned ([\d.]+) MiB, counted ([\d.]+) MiB, counted/planned ([\d.]+)")
step = grab(r"([\d.]+) ms per step")
ev = grab(r"eval loss ([\d.]+)")
heap = grab(r"heap of training steps planned [\d.]+ MiB, counted peak [\d.]+ MiB \(counted/planned ([\d.]+)\)")
if ms is None:
    sys.exit("no model-state line in " + sys.argv[1] + ":\n" + text[-2000:])
row = [sys.argv[2], sys.argv[3], ms[0], ms[1], ms[2], ms[3]]
row += list(sent) if sent else ["0", "0", "-"]
row += [step[0] if step else "-", ev[0] if ev else "-", heap[0] if heap else "-"]
print("| " + " | ".join(row) + " |")
PY
  done
done
