#!/usr/bin/env bash
# The trainer on the resident GPU loop (docs/gpu.md, "The trainer on the resident loop"),
# for a session with a lent GPU. It trains the demo's GPT for STEPS steps with the same
# seed and data order:
# - on the CPU with the direct step (`step = "handwritten"`, the resident step's CPU twin;
#   in bf16 on a CPU without bf16 hardware, candle's graph instead);
# - on the GPU with `step = "resident"` (the step, the FP32 master, AdamW and the norm on
#   the device; the trainer's loader, schedule, evaluation and checkpoints around it);
# - on the GPU with two ranks as threads of one process sharing the GPU (ZeRO-1, through
#   host memory), against the one-rank GPU run;
# - the same two ranks under ZeRO-3 (the compute copy sharded, each block gathered into a
#   slot as it runs), against ZeRO-1's two (within 1e-5: one micro-batch a rank, so the
#   same sums);
# - on the GPU with the optimizer offloaded to the host (`offload_optimizer = true`),
#   against the one-rank GPU run (within 1e-5: the host build of the same kernels);
# - on the GPU with its micro-batches replayed as CUDA graphs (`cuda_graphs = true`),
#   against the one-rank GPU run bit for bit (the same kernels with the same arguments);
# - in bf16, on the GPU with flash attention (`flash_attention = true`: tensor cores, no
#   scores kept), against the one-rank GPU run: losses within 3e-2, the step-1 norm 1e-2;
# - on the GPU with the blocks' parameters offloaded too (`offload_params = true`: two
#   blocks' worth on the device, each block streamed up as it runs), against the run with
#   the optimizer offloaded alone (within 1e-5; bit for bit on the host build);
# fp32, bf16 and fp16 each (fp16: f16 activations under the dynamic loss scale, its
# overflow skip decided on the device; its CPU reference is the fp32 run). fp32: losses
# and gradient norms step by step (the GPU sums in other
# orders: within 2e-3 relative of the CPU over 40 steps, 1e-4 between 1 and 2 ranks), and
# the weights after the last step (relative L2 within 1e-3, and 1e-4 between ranks).
# bf16: losses step by step (3e-2, and 1e-2 between 1 and 2 ranks), and the gradient norm
# at step 1, where every run has the same weights, against the fp32 CPU run's (1e-2): bf16
# runs' later norms follow trajectories that part. fp16: as bf16, tighter (f16 keeps 11
# significant bits to bf16's 8): losses within 1e-2 of the fp32 CPU run's, the step-1
# norm within 2e-3, and 2 ranks within 1e-3 of 1 (step 1's norm 1e-4). It prints each run's median step time,
# loader wait and the ratio to the CPU's, and the loop's device memory planned against
# what the driver reports (within 10%, or 64 MiB for small models); exits 1 if anything
# is off, not finite, or fails.
# - fp8 (the last): the GPT's linear layers in FP8 on the loop against the CPU's
#   simulation of the recipe, and two ranks (deterministic ZeRO-1, each amax the largest
#   over the ranks) against one, bit for bit (fp8_check below);
#   bash scripts/gpu/resident-check.sh [BIN]      (STEPS, default 40; PRECISIONS, default
#                                                  "fp32 bf16 fp16 fp8")
# Rehearsal without a GPU (the same script, the "GPU" runs on the host build):
#   GPU_DEVICE=cpu bash scripts/gpu/resident-check.sh target/release/stoker
set -euo pipefail
cd "$(dirname "$0")/../.."
steps=${STEPS:-40}
gpu=${GPU_DEVICE:-cuda}
out=${OUT:-/tmp}/resident-check
rm -rf "$out" && mkdir -p "$out"
source scripts/gpu/env.sh "${1:-}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true

# config NAME PRECISION STEP DEVICE [RANKS] [OFFLOAD]: the demo's GPT logging every step,
# with a checkpoint and an evaluation at the end, no sample; OFFLOAD "offload" keeps the
# optimizer in host memory, "params" the blocks' parameters too, "graphs" replays the
# micro-batches as CUDA graphs, "flash" runs flash attention, "det" runs deterministic
# ZeRO-1 in micro-batches of 8 (two a window on one rank).
config() {
  local name=$1 prec=$2 step=$3 dev=$4 ranks=${5:-1} offload=${6:-} f=$out/$1-$2.toml
  sed -e "s|^run_dir = .*|run_dir = \"$out/$name-$prec\"|" \
      -e "s|^precision = .*|precision = \"$prec\"\nstep = \"$step\"\ndevice = \"$dev\"|" \
      -e "s|^log_every = .*|log_every = 1|" \
      -e "s|^checkpoint_every = .*|checkpoint_every = $steps|" \
      -e "s|^eval_every = .*|eval_every = $steps|" \
      -e "s|^sample_tokens = .*|sample_tokens = 0|" \
      -e "s|^num_workers = .*|num_workers = 0|" \
      -e "s|^persistent_workers = .*|persistent_workers = false|" \
      configs/shakespeare-gpt.toml > "$f"
  if [ "$ranks" -gt 1 ]; then
    local strategy=zero1
    [ "$name" = gpu3 ] && strategy=zero3
    sed -i -e "s|^micro_batch = .*|micro_batch = 8\nworld_size = $ranks|" "$f"
    printf '\n[parallel]\nstrategy = "%s"\nbackend = "local"\n' "$strategy" >> "$f"
  fi
  [ "$offload" = offload ] && printf '\n[parallel]\noffload_optimizer = true\n' >> "$f"
  [ "$offload" = params ] && printf '\n[parallel]\noffload_optimizer = true\noffload_params = true\n' >> "$f"
  [ "$offload" = graphs ] && sed -i "s|^step = .*|&\ncuda_graphs = true|" "$f"
  [ "$offload" = flash ] && sed -i "s|^step = .*|&\nflash_attention = true|" "$f"
  if [ "$offload" = det ]; then
    if [ "$ranks" -gt 1 ]; then
      printf 'deterministic = true\n' >> "$f"
    else
      sed -i -e "s|^micro_batch = .*|micro_batch = 8|" -e "s|^accumulation_steps = .*|accumulation_steps = 2|" "$f"
      printf '\n[parallel]\nstrategy = "zero1"\ndeterministic = true\n' >> "$f"
    fi
  fi
  echo "$f"
}

# fp8 (#30's item 10): the GPT's linear layers in FP8 on the resident loop (bf16 around
# them, the head in bf16) against the CPU's simulation of the same recipe (`step =
# "graph"`: quantize-dequantize in f32, the head cast too): losses step by step within
# bf16's 3e-2; the gradient norms printed, not checked (the first steps cast at scale 1,
# where E5M2 flushes most gradients, so a norm follows which values round where: 8.4e-2
# apart at step 1 in the rehearsal on the host build); each run's median step printed.
# Then two ranks sharing the GPU (deterministic ZeRO-1 through host memory, a micro-batch
# of 8 each; each scaler's amax of a step the largest over the ranks, so both take one
# rank's scales) against one rank running the same two micro-batches a window: the same
# losses and the same scalers in the last checkpoint, bit for bit (without the reduction
# the scales part from the first step).
fp8_check() {
  local r f
  for r in "cpu8 graph cpu 1" "gpu8 resident $gpu 1" "gpu8d resident $gpu 1 det" \
           "gpu82 resident ${gpu/#cuda/cuda:0} 2 det"; do
    set -- $r
    f=$(config "$1" fp8 "$2" "$3" "$4" "${5:-}")
    echo "== $1 fp8 ($2 on $3): $STOKER_GPU_BIN train $f"
    if ! timeout 150 "$STOKER_GPU_BIN" train "$f" --stop-after "$steps" --no-progress > "$out/$1-fp8.log" 2>&1; then
      echo "FAILED ($out/$1-fp8.log):"; tail -20 "$out/$1-fp8.log"; return 1
    fi
  done
  python3 - "$out" <<'PY'
import json, math, statistics, sys
out = sys.argv[1]
def rows(name):
    rs = [json.loads(l) for l in open(f"{out}/{name}-fp8/metrics.jsonl")]
    return {r["step"]: r for r in rs if r.get("kind") == "train"}
cpu, gpu, one, two = rows("cpu8"), rows("gpu8"), rows("gpu8d"), rows("gpu82")
common = sorted(set(cpu) & set(gpu) & set(one) & set(two))
if not common:
    sys.exit("  fp8: no step in every run FAILED")
rel = lambda a, b: abs(a - b) / max(abs(b), 1e-12)
loss = max(rel(gpu[s]["loss"], cpu[s]["loss"]) for s in common)
last = common[-1]
norms = [rel(gpu[s]["grad_norm"], cpu[s]["grad_norm"]) for s in (common[0], last)]
ok = math.isfinite(loss) and loss <= 3e-2
ms = lambda r: statistics.median(r[k]["step_s"] for k in sorted(r)[2:] or sorted(r)) * 1e3
print(f"  fp8 gpu vs the cpu's simulation: {len(common)} steps, worst loss {loss:.2e} (3e-2) "
      f"{'OK' if ok else 'FAILED'}; gradient norms apart by {norms[0]:.2e} at step {common[0]} "
      f"and {norms[1]:.2e} at step {last} (printed); median step cpu {ms(cpu):.2f} ms, gpu "
      f"{ms(gpu):.2f} ms")
def scalers(name):
    ck = f"{out}/{name}-fp8/checkpoints"
    return json.load(open(f"{ck}/{open(f'{ck}/LATEST').read().strip()}/manifest.json"))["fp8"]
same_losses = all(one[s]["loss"] == two[s]["loss"] for s in common)
differ = sum(one[s]["loss"] != two[s]["loss"] for s in common)
same_scalers = scalers("gpu8d") == scalers("gpu82") and len(scalers("gpu82")) > 0
ranks_ok = same_losses and same_scalers
print(f"  fp8 gpu 2 ranks vs 1 (deterministic): losses {'bit for bit' if same_losses else f'differ at {differ} steps'}, "
      f"{len(scalers('gpu82'))} layers' scalers {'the same' if same_scalers else 'differ'} "
      f"{'OK' if ranks_ok else 'FAILED'}; median step {ms(two):.2f} ms")
sys.exit(0 if ok and ranks_ok else 1)
PY
}

status=0
for prec in ${PRECISIONS:-fp32 bf16 fp16 fp8}; do
  if [ "$prec" = fp8 ]; then
    fp8_check || status=1
    continue
  fi
  runs=("gpu resident $gpu 1" "gpug resident $gpu 1 graphs" "gpu2 resident ${gpu/#cuda/cuda:0} 2" "gpu3 resident ${gpu/#cuda/cuda:0} 2")
  # The CPU reference: the direct step in fp32 and bf16; fp16's is the fp32 run.
  [ "$prec" = fp16 ] || runs=("cpu handwritten cpu 1" "${runs[@]}")
  # Flash attention runs in bf16 alone.
  [ "$prec" = bf16 ] && runs+=("gpuf resident $gpu 1 flash")
  # The optimizer offloaded to the host: a GPU's only (on a CPU there is nothing to
  # offload, and the config says so).
  [ "$gpu" = cpu ] || runs+=("gpuoff resident $gpu 1 offload" "gpupar resident $gpu 1 params")
  for r in "${runs[@]}"; do
    set -- $r
    f=$(config "$1" "$prec" "$2" "$3" "$4" "${5:-}")
    echo "== $1 $prec ($2 on $3, $4 rank(s)): $STOKER_GPU_BIN train $f"
    if ! timeout 150 "$STOKER_GPU_BIN" train "$f" --stop-after "$steps" --no-progress > "$out/$1-$prec.log" 2>&1; then
      echo "FAILED ($out/$1-$prec.log):"; tail -20 "$out/$1-$prec.log"; status=1
    fi
  done
  # Each run's weights after the last step, one file each (the checkpoint at $steps).
  for r in cpu gpu gpug gpu2 gpu3; do
    [ "$r-$prec" = cpu-fp16 ] && continue
    ck=$out/$r-$prec/checkpoints/$(printf 'step_%08d' "$steps")
    "$STOKER_GPU_BIN" ckpt consolidate "$ck" > /dev/null 2>&1 || echo "  $prec $r: no checkpoint at $ck"
  done
  # The loop's memory on the GPU: planned from the sizes its buffers are made with,
  # counted from them, and taken from the device as the driver reports it (item 8: within
  # 10% of the plan, or 64 MiB for small models, where cuBLAS's workspace and NCCL's
  # communicator weigh). The two-rank run shares one GPU between two threads: the driver's
  # figure is the device's, not a rank's, so it is printed, not checked.
  mem_runs="gpu gpu2 gpu3"
  [ "$gpu" = cpu ] || mem_runs="$mem_runs gpupar"
  [ "$prec" = bf16 ] && mem_runs="$mem_runs gpuf"
  for r in $mem_runs; do
    line=$(grep -h -m1 "resident loop per rank" "$out/$r-$prec.log" || true)
    echo "  $prec $r: ${line:-no memory line}"
    [ "$r" = gpu2 ] || [ "$r" = gpu3 ] && continue
    python3 - "$line" "$gpu" <<'PY' || status=1
import re, sys
line, device = sys.argv[1], sys.argv[2]
planned = re.search(r"planned ([0-9.]+) MiB", line)
measured = re.search(r"as its driver reports it ([0-9.]+) MiB", line)
if device == "cpu":
    sys.exit(0)
if not planned or not measured:
    sys.exit("  no planned or measured device memory in the run's output: FAILED")
p, m = float(planned.group(1)), float(measured.group(1))
slack = max(0.10 * p, 64.0)
ok = abs(m - p) <= slack
print(f"  device memory: measured {m:.1f} MiB, planned {p:.1f} MiB, allowed +-{slack:.1f} MiB: "
      f"{'OK' if ok else 'FAILED'}")
sys.exit(0 if ok else 1)
PY
  done
  python3 - "$out" "$prec" <<'EOF' || status=1
import json, math, statistics, sys
out, prec = sys.argv[1], sys.argv[2]
def rows(name, p=prec):
    try:
        rs = [json.loads(l) for l in open(f"{out}/{name}-{p}/metrics.jsonl")]
    except OSError as e:
        sys.exit(f"  {name} {p}: no metrics: {e}")
    return {r["step"]: r for r in rs if r.get("kind") == "train"}
def median_ms(r):
    s = sorted(r)
    return statistics.median(r[k]["step_s"] for k in s[2:] or s) * 1e3
def rel(a, b):
    # A skipped fp16 step logs no gradient norm (null): NaN, which no check passes.
    a, b = (math.nan if v is None else v for v in (a, b))
    return abs(a - b) / max(abs(b), 1e-12)
# fp16 has no CPU run of its own: the fp32 one is its reference.
cpu_prec = "fp32" if prec == "fp16" else prec
cpu, gpu, gpu2 = rows("cpu", cpu_prec), rows("gpu"), rows("gpu2")
skips = sum(1 for r in gpu.values() if r.get("skipped"))
if prec == "fp16":
    print(f"  fp16: {skips} of {len(gpu)} steps skipped on an overflow; loss scale at the end "
          f"{gpu[max(gpu)].get('loss_scale')}")
ok = True
def check(name, a, b, keys, tol, steps=None):
    global ok
    common = sorted(set(a) & set(b)) if steps is None else [s for s in steps if s in a and s in b]
    if not common:
        print(f"  {prec} {name}: no step in both runs"); ok = False; return
    worst = {k: max(rel(a[s][k], b[s][k]) for s in common) for k in keys}
    finite = all(r[s][k] is not None and math.isfinite(r[s][k])
                 for r in (a, b) for s in common for k in keys)
    good = finite and all(w <= tol for w in worst.values())
    ok &= good
    what = ", ".join(f"{k} {w:.2e}" for k, w in worst.items())
    print(f"  {prec} {name}: {len(common)} step(s) from {common[0]}: worst relative difference "
          f"{what} (tolerance {tol:.0e}) {'OK' if good else 'FAILED'}")
if prec == "fp32":
    # The same trajectory: losses and norms step by step.
    check("gpu vs cpu", gpu, cpu, ("loss", "grad_norm"), 2e-3)
    check("gpu 2 ranks vs 1", gpu2, gpu, ("loss", "grad_norm"), 1e-4)
elif prec == "fp16":
    # f16 keeps 11 significant bits: the bf16 checks, tighter, against the fp32 CPU run.
    # The norms at the first step the scaler did not skip (a skipped step logs none).
    first = min((s for s in gpu if not gpu[s].get("skipped")), default=1)
    check("gpu vs cpu fp32", gpu, cpu, ("loss",), 1e-2)
    check(f"gpu vs cpu fp32 at step {first}", gpu, cpu, ("grad_norm",), 2e-3, steps=[first])
    check("gpu 2 ranks vs 1", gpu2, gpu, ("loss",), 1e-3)
    check(f"gpu 2 ranks vs 1 at step {first}", gpu2, gpu, ("grad_norm",), 1e-4, steps=[first])
else:
    # bf16 trajectories part after a few steps and their gradient norms are spiky: the
    # losses step by step; the norm at step 1 (the same weights everywhere) against the
    # fp32 reference's (the CPU's bf16 direct step's own step-1 norm is printed beside it).
    check("gpu vs cpu", gpu, cpu, ("loss",), 3e-2)
    ref = rows("cpu", "fp32")
    check("gpu vs cpu fp32 at step 1", gpu, ref, ("grad_norm",), 1e-2, steps=[1])
    print(f"  {prec} (for comparison) the cpu bf16 run at step 1 (`step = \"handwritten\"`: the graph where the CPU has no bf16 hardware): grad norm "
          f"{cpu[1]['grad_norm']:.5f} against fp32 {ref[1]['grad_norm']:.5f}")
    check("gpu 2 ranks vs 1", gpu2, gpu, ("loss",), 1e-2)
    check("gpu 2 ranks vs 1 at step 1", gpu2, gpu, ("grad_norm",), 1e-3, steps=[1])
# The weights after the last step (relative L2 over the whole model). fp32 follows one
# trajectory: checked. bf16 trajectories part under AdamW (rehearsed on the host build:
# 8.7e-2 against fp32, 3.4e-2 between 2 ranks and 1, after 40 steps): printed.
from array import array
import struct
def weights(name, p=prec):
    path = f"{out}/{name}-{p}/checkpoints/step_{max(cpu):08d}/model.safetensors"
    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
            data = f.read()
    except OSError as e:
        return None
    w = {}
    for k, t in header.items():
        if k != "__metadata__" and t["dtype"] == "F32":
            a, b = t["data_offsets"]
            v = array("f"); v.frombytes(data[a:b]); w[k] = v
    return w
def rel_l2(a, b):
    num = den = 0.0
    for k in b:
        for p, q in zip(a[k], b[k]):
            num += (p - q) ** 2; den += q * q
    return math.sqrt(num / den) if den > 0 else float("nan")
wc, wg, wg2, wg3 = weights("cpu", cpu_prec), weights("gpu"), weights("gpu2"), weights("gpu3")
for name, a, b, tol in [("gpu vs cpu", wg, wc, 1e-3), ("gpu 2 ranks vs 1", wg2, wg, 1e-4),
                        ("gpu zero-3 vs zero-1 at 2 ranks", wg3, wg2, 1e-5)]:
    if a is None or b is None or a.keys() != b.keys():
        print(f"  {prec} {name}: weights missing or of other parameters FAILED"); ok = False; continue
    d = rel_l2(a, b)
    if prec == "fp32":
        good = math.isfinite(d) and d <= tol
        ok &= good
        print(f"  {prec} {name}: weights after the last step differ by {d:.2e} (relative L2, "
              f"tolerance {tol:.0e}) {'OK' if good else 'FAILED'}")
    else:
        print(f"  {prec} {name}: weights after the last step differ by {d:.2e} (relative L2; "
              f"printed, not checked)")
# The micro-batches replayed as CUDA graphs: the same launches with the same arguments,
# so the same bits step by step and in the weights.
import os
if os.path.exists(f"{out}/gpug-{prec}/metrics.jsonl"):
    check("gpu cuda graphs vs launched one by one", rows("gpug"), gpu, ("loss", "grad_norm"), 0.0)
    d = rel_l2(weights("gpug"), wg) if weights("gpug") and wg else float("nan")
    good = d == 0.0
    ok &= good
    print(f"  {prec} gpu cuda graphs vs launched one by one: weights after the last step differ "
          f"by {d:.2e} (bit for bit expected) {'OK' if good else 'FAILED'}")
    print(f"  {prec}: median step with cuda graphs {median_ms(rows('gpug')):.2f} ms")
# Flash attention (bf16): the tensor cores' sums and bf16 probabilities, the trajectory
# of the kept scores within bf16's tolerances.
if os.path.exists(f"{out}/gpuf-{prec}/metrics.jsonl"):
    gpuf = rows("gpuf")
    check("gpu flash attention vs scores kept", gpuf, gpu, ("loss",), 3e-2)
    check("gpu flash attention vs scores kept at step 1", gpuf, gpu, ("grad_norm",), 1e-2, steps=[1])
    print(f"  {prec}: median step with flash attention {median_ms(gpuf):.2f} ms")
# ZeRO-3 at 2 ranks against ZeRO-1's: one micro-batch a rank, so the same sums.
if os.path.exists(f"{out}/gpu3-{prec}/metrics.jsonl"):
    check("gpu zero-3 vs zero-1 at 2 ranks", rows("gpu3"), gpu2, ("loss", "grad_norm"), 1e-5)
# The optimizer offloaded to the host runs the host build of the kernels the GPU runs
# (which the `kernels` part holds to the same bits): the same run within float noise.
if os.path.exists(f"{out}/gpuoff-{prec}/metrics.jsonl"):
    gpuoff = rows("gpuoff")
    check("gpu offloaded optimizer vs on the gpu", gpuoff, gpu, ("loss", "grad_norm"), 1e-5)
    print(f"  {prec}: median step with the optimizer offloaded {median_ms(gpuoff):.2f} ms")
    if os.path.exists(f"{out}/gpupar-{prec}/metrics.jsonl"):
        gpupar = rows("gpupar")
        check("gpu parameters offloaded vs the optimizer alone", gpupar, gpuoff, ("loss", "grad_norm"), 1e-5)
        print(f"  {prec}: median step with the parameters offloaded too {median_ms(gpupar):.2f} ms")
t = {n: median_ms(r) for n, r in (("cpu", cpu), ("gpu", gpu), ("gpu2", gpu2))}
wait = {n: statistics.median(r[k]["loader_wait_pct"] for k in r) for n, r in
        (("cpu", cpu), ("gpu", gpu), ("gpu2", gpu2))}
print(f"  {prec}: median step cpu (step = handwritten) {t['cpu']:.2f} ms, gpu resident {t['gpu']:.2f} ms "
      f"(gpu/cpu {t['gpu'] / t['cpu']:.3f}), gpu 2 ranks {t['gpu2']:.2f} ms; loader wait "
      f"cpu {wait['cpu']:.2f}% gpu {wait['gpu']:.2f}% gpu2 {wait['gpu2']:.2f}%")
sys.exit(0 if ok else 1)
EOF
done
[ $status = 0 ] && echo "resident check: PASSED" || echo "resident check: FAILED"
exit $status
