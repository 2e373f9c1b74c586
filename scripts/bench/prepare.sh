#!/usr/bin/env bash
# Data preparation, side by side in one run on one generated corpus (MB of text, default
# 200; Shakespeare's plays cut into web-sized documents, as Parquet shards): stoker pack docs
# against nanoGPT's single-process tiktoken recipe and llm.c's datasets.map(num_proc) one,
# MB/s in and tokens/s out, and a check that the token ids are identical.
# Usage: bash scripts/bench/prepare.sh [MB]   (make bench-prepare; needs pip's tiktoken,
# pyarrow and datasets, which it installs)
set -euo pipefail
cd "$(dirname "$0")/../.."
MB=${1:-200}
STOKER=target/release/stoker
CORES=$(nproc)
python3 -c 'import tiktoken, pyarrow, datasets' 2>/dev/null || python3 -m pip install -q tiktoken pyarrow datasets 2>&1 | grep -v WARNING || true
# GPT-2's ranks for Python's tiktoken: tiktoken-rs's copy (tiktoken would download it).
R50K=$(find "${CARGO_HOME:-$HOME/.cargo}/registry/src" -path '*tiktoken-rs-*/assets/r50k_base.tiktoken' | head -1)
[ -n "$R50K" ] || { echo "error: tiktoken-rs's r50k_base.tiktoken not found (cargo build first)" >&2; exit 1; }
export R50K
W=runs/bench-prepare
mkdir -p "$W"
if [ ! -d "$W/corpus" ]; then
  python3 scripts/bench/prepare_corpus.py data/raw/shakespeare "$W/corpus" "$MB"
fi
echo "== $(date -u +%FT%TZ) $CORES cores, $(du -sh "$W/corpus" | cut -f1) of Parquet"
rm -rf "$W/stoker"
t0=$(date +%s.%N)
"$STOKER" pack docs "$W/stoker/corpus" "$W/corpus" --tokenizer gpt2 --shard-tokens 100000000 | head -1
t1=$(date +%s.%N)
echo "stoker (wall, start to exit): $(python3 -c "print(f'{$t1 - $t0:.2f}')") s"
python3 scripts/bench/prepare_python.py single "$W/corpus" "$W/single.u16"
python3 scripts/bench/prepare_python.py datasets "$W/corpus" "$W/datasets.u16" "$CORES"
python3 - "$W" <<'PY'
import glob, sys
import numpy as np
w = sys.argv[1]
ours = np.concatenate([np.fromfile(f, dtype=np.uint16, offset=1024)
                       for f in sorted(glob.glob(f"{w}/stoker/corpus_*.bin"))])
for name in ["single", "datasets"]:
    theirs = np.fromfile(f"{w}/{name}.u16", dtype=np.uint16)
    same = len(ours) == len(theirs) and bool((ours == theirs).all())
    print(f"token ids, stoker vs {name}: {'identical' if same else 'DIFFERENT'} ({len(ours)} vs {len(theirs)} tokens)")
    if not same:
        sys.exit(1)
PY
