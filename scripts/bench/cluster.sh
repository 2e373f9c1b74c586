#!/usr/bin/env bash
# The chapter's network case at this machine's scale (issue #13, docs/distributed.md): DDP vs
# ZeRO-3 on 2 "nodes" (network namespaces, one core each) joined by shaped links
# (scripts/cluster.sh), on a fast and a slow link, beside `stoker plan`'s prediction for the
# same model, batch and link. The model is configs/shakespeare-gpt-zero.toml's (8 blocks,
# 1.6M parameters, bf16) on a generated text (no download needed).
# Usage: bash scripts/bench/cluster.sh [RATE...]   (default: unshaped 10gbit 1gbit 100mbit)
set -euo pipefail
cd "$(dirname "$0")/../.."
# Plans from each config's own calibration, written into it; no machine profile is read or
# written (`stoker plan --calibrate` would record the steps in the user's).
export STOKER_PROFILE=off
S=${STOKER:-target/release/stoker}
[ -x "$S" ] || { echo "error: $S not built (cargo build --release -p stoker-cli)" >&2; exit 1; }
S=$(realpath "$S")
rates=("$@")
((${#rates[@]})) || rates=(unshaped 10gbit 1gbit 100mbit)
STEPS=${STEPS:-30}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -c "
import random; r = random.Random(7); words = 'the a cat sat on mat and dog ran to of king queen lord my thy'.split()
print(' '.join(r.choice(words) for _ in range(60000)))" > "$work/text.txt"
"$S" pack text "$work/corpus" "$work/text.txt" --tokenizer char > /dev/null
gbit() { case "$1" in *gbit) echo "${1%gbit}" ;; *mbit) python3 -c "print(${1%mbit} / 1000)" ;; esac; }
printf '| link | strategy | plan: step (ms) | plan: compute (ms) | plan: exposed comm (ms) | plan: ZeRO-3 comm-bound | step measured (ms) | step measured/plan | sent/rank (MiB, trainer plan) | its time on the link (ms) | comm measured (ms) | comm measured/link time |\n'
printf '|---|---|---|---|---|---|---|---|---|---|---|---|\n'
# The config's step calibrated once, before any run (the compute does not depend on the
# link, and calibrating before each run gave 126-203 ms of compute for the same step): timed by 2
# ranks of one thread at once (the two "nodes" share this machine's cores), planned as 2
# nodes; each link's plan below reads these figures from the emitted config's [plan].
sed -e "s#^run_dir = .*#run_dir = \"$work/calibration\"#" \
    -e "s#^train = .*#train = \"$work/corpus.bin\"#" \
    -e "s#^vocab = \"data.*#vocab = \"$work/corpus.vocab.json\"#" \
    -e "s#^num_workers = .*#num_workers = 0#" \
    -e "s#^persistent_workers = .*#persistent_workers = false#" \
    configs/shakespeare-gpt-zero.toml > "$work/calibrate.toml"
RAYON_NUM_THREADS=1 "$S" plan --config "$work/calibrate.toml" --calibrate --calibrate-ranks-at-once 2 \
  --nodes 2 --devices-per-node 1 --inter-node-gbit-s 100 --emit-config "$work/calibrated.toml" \
  > "$work/calibration" 2>&1 || { cat "$work/calibration"; exit 1; }
grep -E "training step|MFU" "$work/calibration" >&2
# What the path between the namespaces carries when no shaper limits it: TCP over veth
# through the bridge, both cores busy, is CPU-bound well below any "unshaped" figure (about
# 8 Gbit/s here, 2026-12-04). Each link is planned at the lesser of its shaped rate and this,
# measured as the run will use it: all_reduce bus bandwidth at 4-16 MiB over the same
# namespaces and MPI transport (stoker bench comm).
timeout 300 bash scripts/cluster.sh -n 2 --rate none -- "$S" bench comm --min-kib 4096 --max-mib 16 \
  --seconds 1 --json "$work/path.json" > "$work/path.log" 2>&1 || { tail -20 "$work/path.log"; exit 1; }
path_gbit=$(python3 - "$work/path.json" <<'PY'
import json, statistics, sys
rows = json.load(open(sys.argv[1]))
bw = [r["stoker_busbw_gbs"] for r in rows if r["op"] == "all_reduce"]
print(f"{8 * statistics.median(bw):.3f}")
PY
)
echo "unshaped path: all_reduce bus bandwidth $path_gbit Gbit/s (median over 4-16 MiB); each link is planned at min(its rate, this)" >&2
declare -A base
for rate in "${rates[@]}"; do
  for strategy in ddp zero3; do
    name="$strategy-$rate"
    sed -e "s#^run_dir = .*#run_dir = \"$work/$name\"#" \
        -e "s#^train = .*#train = \"$work/corpus.bin\"#" \
        -e "s#^vocab = \"data.*#vocab = \"$work/corpus.vocab.json\"#" \
        -e "s#^strategy = .*#strategy = \"$strategy\"#" \
        -e "s#^steps = .*#steps = $STEPS#" \
        -e "s#^eval_every = .*#eval_every = 0#" \
        -e "s#^checkpoint_every = .*#checkpoint_every = 0#" \
        -e "s#^num_workers = .*#num_workers = 0#" \
        -e "s#^persistent_workers = .*#persistent_workers = false#" \
        configs/shakespeare-gpt-zero.toml > "$work/$name.toml"
    if [ "$rate" = unshaped ]; then
      RAYON_NUM_THREADS=1 timeout 600 bash scripts/cluster.sh -n 2 --rate none -- "$S" train "$work/$name.toml" --no-progress > "$work/$name.log" 2>&1 || { tail -20 "$work/$name.log"; exit 1; }
    else
      RAYON_NUM_THREADS=1 timeout 600 bash scripts/cluster.sh -n 2 --rate "$rate" -- "$S" train "$work/$name.toml" --no-progress > "$work/$name.log" 2>&1 || { tail -20 "$work/$name.log"; exit 1; }
    fi
    link=$([ "$rate" = unshaped ] && echo "$path_gbit" || gbit "$rate")
    link=$(python3 -c "print(min($link, $path_gbit))")
    # The plan of the config as calibrated above, over the link of this run, with the
    # trainer's FP32 collectives; the cores push the path's rate through TCP whatever the
    # link (--host-net-gbit-s: that part of ZeRO-3's collectives cannot hide).
    "$S" plan --config "$work/calibrated.toml" --nodes 2 --devices-per-node 1 \
      --inter-node-gbit-s "$link" --host-net-gbit-s "$path_gbit" --json \
      > "$work/$name.plan.json" 2> "$work/$name.plan.err" \
      || { cat "$work/$name.plan.err"; exit 1; }
    python3 - "$work/$name.log" "$work/$name.plan.json" "$rate" "$strategy" "$work/base-$strategy" "$link" <<'PY'
import json, os, re, sys
log, plan_file, rate, strategy, base_file, link = sys.argv[1:]
text = open(log).read()
m = re.search(r"ranks: 2 \(\w+\), ([\d.]+) ms per step", text)
if not m:
    sys.exit("no step line in " + log + ":\n" + text[-3000:])
step = float(m.group(1))
plan = json.load(open(plan_file))
row = next(r for r in plan["strategies"] if r["label"] == strategy)
t = row["time"]
planned_step, planned_comm, compute = 1e3 * t["step_s"], 1e3 * t["exposed_comm_s"], 1e3 * t["compute_s"]
if rate == "unshaped":
    open(base_file, "w").write(str(step))
base = float(open(base_file).read()) if os.path.exists(base_file) else None
comm = step - base if base is not None else None
warn = any("ZeRO-3 is communication-bound" in w for w in plan["decision"].get("warnings", []))
sent = re.search(r"bytes sent per step per rank: planned ([\d.]+) MiB", text)
sent_mib = float(sent.group(1)) if sent else None
link_ms = None if sent_mib is None or rate == "unshaped" else 1e3 * sent_mib * 2**20 / (float(link) * 1e9 / 8)
f = lambda x: "-" if x is None else f"{x:.1f}"
ratio = lambda a, b: "-" if a is None or b is None or b <= 0.5 else f"{a / b:.2f}"
print(f"| {rate} | {strategy} | {planned_step:.1f} | {compute:.1f} | {planned_comm:.1f} | {'yes' if warn else 'no'} | {step:.1f} | {step / planned_step:.2f} | {f(sent_mib)} | {f(link_ms)} | {f(comm)} | {ratio(comm, link_ms)} |")
PY
  done
done
echo "(comm measured = step on the shaped link - step on the unshaped one, same strategy; link time = the trainer's planned bytes sent per rank / the link rate; 2 ranks x 1 thread, $STEPS steps, mean)"
