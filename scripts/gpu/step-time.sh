#!/usr/bin/env bash
# Step time on the GPU, stoker against PyTorch on the same machine, for two GPTs of the
# same architecture: the demo's (d_model 128, 4 blocks, context 128, batch 16; 0.82M
# parameters) and #13's (d_model 320, 5 blocks, 5 heads, context 192, batch 12; 6.2M with
# the demo's 96-token vocabulary). stoker, `device = "cuda"`, two paths: `graph`, candle's
# ops with the optimizer offloaded to the host; and `resident`, stoker's own GPU step
# with the master and AdamW on the device (docs/gpu.md), in bf16 also with its
# micro-batches replayed as CUDA graphs (`cuda_graphs = true`) and with flash attention
# (`flash_attention = true`), and with the blocks' parameters offloaded to the host
# (`offload_params = true`). PyTorch: the whole model and
# fused AdamW on the GPU, fp32 and bf16 autocast (scripts/gpu/torch_step.py). Median step
# time over STEPS steps after warm-up, each figure and stoker / PyTorch.
#   bash scripts/gpu/step-time.sh [BIN]      (STEPS, default 40)
set -euo pipefail
cd "$(dirname "$0")/../.."
steps=${STEPS:-40}
out=${OUT:-/tmp}/step-time
rm -rf "$out" && mkdir -p "$out"
source scripts/gpu/env.sh "${1:-}"

# shape NAME D_MODEL LAYERS HEADS CONTEXT BATCH
shapes=("demo 128 4 4 128 16" "issue13 320 5 5 192 12")
status=0
for sh in "${shapes[@]}"; do
  set -- $sh
  torch=$(timeout 180 python3 scripts/gpu/torch_step.py --d-model "$2" --layers "$3" --heads "$4" \
    --context "$5" --batch "$6" --steps "$steps") || { echo "FAILED torch $1"; status=1; continue; }
  echo "$torch"
  for run in fp32-graph bf16-graph fp32-resident bf16-resident bf16-resident+cudagraphs bf16-resident+flash \
      bf16-resident+offload; do
    prec=${run%%-*} path=${run#*-}
    f=$out/$1-$run.toml
    case $path in
      graph) keys="kernels = \"composed\"" ;;
      resident) keys="step = \"resident\"" ;;
      # Each micro-batch captured once and replayed as one CUDA graph (`cuda_graphs`).
      resident+cudagraphs) keys="step = \"resident\"\ncuda_graphs = true" ;;
      # Attention on tensor cores keeping no scores (`flash_attention`).
      resident+flash) keys="step = \"resident\"\nflash_attention = true" ;;
      # The blocks' parameters and the optimizer in host memory, their copies on the copy
      # stream beside the kernels (`offload_params`): what the overlap leaves of the cost.
      resident+offload) keys="step = \"resident\"" ;;
    esac
    sed -e "s|^run_dir = .*|run_dir = \"$out/$1-$run\"|" \
        -e "s|^precision = .*|precision = \"$prec\"\n$keys\ndevice = \"cuda\"|" \
        -e "s|^d_model = .*|d_model = $2|" -e "s|^n_layer = .*|n_layer = $3|" \
        -e "s|^n_head = .*|n_head = $4|" -e "s|^context = .*|context = $5|" \
        -e "s|^micro_batch = .*|micro_batch = $6|" -e "s|^global_batch = .*|global_batch = $6|" \
        -e "s|^log_every = .*|log_every = 1|" \
        -e "s|^checkpoint_every = .*|checkpoint_every = 100000|" \
        -e "s|^eval_every = .*|eval_every = 100000|" \
        -e "s|^sample_tokens = .*|sample_tokens = 0|" \
        configs/shakespeare-gpt.toml > "$f"
    [ "$path" = graph ] && printf '\n[parallel]\noffload_optimizer = true\n' >> "$f"
    [ "$path" = resident+offload ] &&
      printf '\n[parallel]\noffload_optimizer = true\noffload_params = true\n' >> "$f"
    if ! timeout 180 "$STOKER_GPU_BIN" train "$f" --stop-after "$((steps + 5))" --no-progress > "$out/$1-$run.log" 2>&1; then
      echo "FAILED stoker $1 $run ($out/$1-$run.log):"; tail -15 "$out/$1-$run.log"; status=1; continue
    fi
    t_torch=$(echo "$torch" | sed -n "s/.* $prec: .*median step \([0-9.]*\) ms.*/\1/p")
    python3 - "$out/$1-$run/metrics.jsonl" "$1" "$run" "$t_torch" "$(grep -m1 '^parameters' "$out/$1-$run.log")" <<'PY'
import json, statistics, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if r.get("kind") == "train"]
t = statistics.median(r["step_s"] for r in rows[5:]) * 1e3
torch = float(sys.argv[4])
print(f"stoker {sys.argv[2]} {sys.argv[3]} ({sys.argv[5]}): median step {t:.2f} ms over {len(rows) - 5} steps; "
      f"PyTorch {torch:.2f} ms; stoker / PyTorch {t / torch:.2f}")
PY
  done
done
exit $status
