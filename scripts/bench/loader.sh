#!/usr/bin/env bash
# Loader benchmark (make bench-loader): stoker vs a plain memcpy of the same bytes and vs
# torch's DataLoader over the same .npy through np.memmap, all in one run; then peak memory of
# the whole process tree with 1 and 8 workers for both. Needs torch (installed from PyPI for
# this script only) and a release build of stoker.
set -euo pipefail
cd "$(dirname "$0")/../.."
STOKER=target/release/stoker
N="${N:-50000}"
SECONDS_PER="${SECONDS_PER:-3}"
python3 -c 'import torch, numpy' 2>/dev/null || python3 -m pip install -q torch numpy
[ -f data/bench/synth.image.npy ] || python3 scripts/bench/make_synth_npy.py data/bench/synth "$N"
echo "== stoker (memcpy baseline measured in the same process) =="
"$STOKER" bench loader data/bench/synth --batch 256 --seconds "$SECONDS_PER" --workers 0,1,2,4 | tee /tmp/stoker-loader.txt
echo "== torch.utils.data.DataLoader over np.memmap =="
python3 scripts/bench/torch_loader.py data/bench/synth --batch 256 --seconds "$SECONDS_PER" --workers 0,1,2,4 2>/dev/null | tee /tmp/torch-loader.txt
stoker_best=$(awk '/^ +[0-9]+ +[0-9]+ +[0-9]/ { if ($3 > b) b = $3 } END { print b }' /tmp/stoker-loader.txt)
torch_best=$(awk '/^best:/ { print $4 }' /tmp/torch-loader.txt)
python3 -c "print(f'stoker best {float($stoker_best):.0f} samples/s vs DataLoader best {float($torch_best):.0f}: {float($stoker_best)/float($torch_best):.2f}x')"
echo "== peak memory of the process tree =="
for w in 1 8; do
  echo "stoker  num_workers $w: $(python3 scripts/bench/peak_mem.py -- "$STOKER" bench loader data/bench/synth --batch 256 --seconds "$SECONDS_PER" --workers $w)"
  echo "torch   num_workers $w: $(python3 scripts/bench/peak_mem.py -- python3 scripts/bench/torch_loader.py data/bench/synth --batch 256 --seconds "$SECONDS_PER" --workers $w)"
done
