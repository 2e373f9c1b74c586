#!/usr/bin/env bash
# The main job (make demo): the data pipeline on real data, then a char-level GPT trained on
# Shakespeare in bf16, a text sample, and the report plots.
set -euo pipefail
cd "$(dirname "$0")/.."
STOKER=target/release/stoker
echo "== loader on MNIST (60,000 x 1x28x28 u8), shuffled, batch 256 =="
"$STOKER" bench loader data/mnist/train --batch 256 --seconds 2 --workers 0,1,2
echo
echo "== calibrate this machine once: its profile (GEMM rates, bandwidths, the training step of GPTs 64-512 wide) plans every later run on it =="
mkdir -p runs
# The demo keeps its profile in runs/ (by default it is ~/.config/stoker/profile.toml).
export STOKER_PROFILE=runs/machine-profile.toml
"$STOKER" plan --calibrate | tail -n 6
echo
echo "== plan: the chapter's decision flow for the Shakespeare GPT's config, on this machine's profile (precision too: bf16 where the CPU has bf16 instructions, else fp32) =="
"$STOKER" plan --config configs/shakespeare-gpt.toml --precision auto --emit-config runs/shakespeare.toml | sed -n '1,/^model /p;/Decision path/,$p'
echo
echo "== loader autotune with the plan's need ([plan] required_samples_per_s in runs/shakespeare.toml; 0 workers tried first), written into its [data] =="
"$STOKER" tune loader data/shakespeare/shakespeare.bin --seconds 1 --max-workers 8 --from-plan runs/shakespeare.toml --write-config
echo
echo "== train the emitted config as is: char-level GPT (~0.8M parameters, in the precision the plan chose) on Shakespeare, planned vs measured at the end =="
rm -rf runs/shakespeare
RAYON_NUM_THREADS=2 "$STOKER" train runs/shakespeare.toml --summary-json runs/shakespeare.json | tee runs/shakespeare.log
"$STOKER" report runs/shakespeare
# The run's results as JSON (--summary-json): the checks read fields, not printed prose.
field() { python3 -c 'import json, sys; v = json.load(open(sys.argv[1])); [v := v[k] for k in sys.argv[2:]]; print(v)' "$@"; }
eval_loss=$(field runs/shakespeare.json eval_loss)
python3 -c "import sys; sys.exit(0 if $eval_loss <= 2.0 else 1)" || { echo "error: eval loss $eval_loss is above 2.0" >&2; exit 1; }
echo "eval loss $eval_loss <= 2.0"
echo "plots: runs/shakespeare/*.png"
echo
echo "== the same job on a Llama (RMSNorm, RoPE, grouped-query attention, SwiGLU; ~0.76M parameters): planned on the profile, trained, exported as LlamaForCausalLM =="
"$STOKER" plan --config configs/shakespeare-llama.toml --precision auto --emit-config runs/shakespeare-llama.toml | sed -n '1,/^model /p;/^Chosen/p'
rm -rf runs/shakespeare-llama
RAYON_NUM_THREADS=2 "$STOKER" train runs/shakespeare-llama.toml --no-progress --summary-json runs/llama.json | grep -E "^parameters|^eval loss|^throughput|^planned vs measured"
llama_loss=$(field runs/llama.json eval_loss)
python3 -c "import sys; sys.exit(0 if $llama_loss <= 2.0 else 1)" || { echo "error: the Llama's eval loss $llama_loss is above 2.0" >&2; exit 1; }
echo "Llama eval loss $llama_loss <= 2.0 (the GPT's: $eval_loss)"
"$STOKER" export hf runs/shakespeare-llama.toml --out runs/shakespeare-llama/hf
echo
echo "== data parallelism: the same GPT and global batch on 1 rank, then on 2 ranks (mpirun -n 2), deterministic mode =="
echo "   (each config planned for its rank count on this machine's profile, and trained as emitted)"
mkdir -p runs
rm -rf runs/shakespeare-ddp runs/shakespeare-ddp-2ranks
"$STOKER" plan --config configs/shakespeare-gpt-ddp.toml --devices-per-node 1 --strategy ddp --precision auto \
  --emit-config runs/shakespeare-gpt-ddp-1rank.toml > runs/plan-ddp-1rank.txt
"$STOKER" plan --config configs/shakespeare-gpt-ddp.toml --devices-per-node 2 --strategy ddp --precision auto \
  --run-dir runs/shakespeare-ddp-2ranks --emit-config runs/shakespeare-gpt-ddp-2ranks.toml > runs/plan-ddp-2ranks.txt
RAYON_NUM_THREADS=2 "$STOKER" train runs/shakespeare-gpt-ddp-1rank.toml --no-progress --summary-json runs/ddp-1rank.json | tee runs/ddp-1rank.log
timeout 900 mpirun -n 2 "$STOKER" train runs/shakespeare-gpt-ddp-2ranks.toml --no-progress --summary-json runs/ddp-2ranks.json | tee runs/ddp-2ranks.log
one="eval loss $(field runs/ddp-1rank.json eval_loss), weights crc32 $(field runs/ddp-1rank.json weights_crc32)"
two="eval loss $(field runs/ddp-2ranks.json eval_loss), weights crc32 $(field runs/ddp-2ranks.json weights_crc32)"
if [ "$one" = "$two" ]; then
  echo "1 rank and 2 ranks agree bit for bit: $one"
else
  echo "1 rank: $one"
  echo "2 ranks: $two"
  echo "error: the 2-rank run differs from the 1-rank run" >&2
  exit 1
fi
echo
echo "== ZeRO-3: an 8-block GPT (1.6M parameters) over 2 ranks; each keeps half of the parameters, gradients and optimizer states =="
rm -rf runs/shakespeare-zero
# The planner recommends DDP here (the model fits whole on each rank); the demo runs
# ZeRO-3 to show the sharding, and the run's own forecast plans the strategy it runs.
"$STOKER" plan --config configs/shakespeare-gpt-zero.toml --devices-per-node 2 --strategy zero3 --precision auto \
  --emit-config runs/shakespeare-gpt-zero3-2ranks.toml > runs/plan-zero3-2ranks.txt
grep -E "^\(c\) strategy|asks for zero3" runs/plan-zero3-2ranks.txt
sed -i -e 's#^strategy = .*#strategy = "zero3"#' \
  -e '1i # scripts/demo.sh set strategy = "zero3" over the plan'"'"'s choice below, to show ZeRO-3' \
  runs/shakespeare-gpt-zero3-2ranks.toml
timeout 900 mpirun -n 2 "$STOKER" train runs/shakespeare-gpt-zero3-2ranks.toml --no-progress --summary-json runs/zero3-2ranks.json | tee runs/zero3-2ranks.log
held=$(field runs/zero3-2ranks.json model_states ratio)
python3 -c "import sys; sys.exit(0 if abs($held - 1) <= 0.01 else 1)" || { echo "error: held model states are $held of the plan" >&2; exit 1; }
echo
echo "== resume the 2-rank ZeRO-3 checkpoint on 1 rank (DDP), 20 more steps; then one model.safetensors and a Hugging Face GPT-2 directory =="
planned_precision=$(grep '^precision = ' runs/shakespeare-gpt-zero3-2ranks.toml)
sed -e 's#^strategy = .*#strategy = "ddp"#' -e 's#^steps = .*#steps = 120#' -e "s#^precision = .*#$planned_precision#" \
  configs/shakespeare-gpt-zero.toml > runs/shakespeare-gpt-zero-resume.toml
RAYON_NUM_THREADS=2 "$STOKER" train runs/shakespeare-gpt-zero-resume.toml --resume latest --no-progress | grep -E "^eval loss|^steps"
"$STOKER" ckpt consolidate runs/shakespeare-zero/checkpoints/step_00000120
"$STOKER" export hf runs/shakespeare-gpt-zero-resume.toml --out runs/shakespeare-zero/hf
echo
echo "== planned vs measured, every training run above (the forecast each printed at its start, checked at its end) =="
for run in shakespeare llama ddp-1rank ddp-2ranks zero3-2ranks; do
  python3 - "runs/$run.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
def part(name, key, unit, scale):
    p = s.get(key)
    if not p or p["ratio"] is None:
        return f"{name}: not planned"
    return f"{name} {p['measured'] * scale:.1f} {unit} (measured/planned {p['ratio']:.2f})"
print(f"{sys.argv[1]}: " + "; ".join([
    part("training steps' peak RSS", "train_memory", "MiB", 1 / 2**20),
    part("whole run's peak", "run_memory", "MiB", 1 / 2**20),
    part("step time", "step_time", "ms", 1e3),
]))
PY
done
