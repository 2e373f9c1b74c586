#!/usr/bin/env bash
# The test suite, as CI runs it (make test).
set -euo pipefail
cd "$(dirname "$0")/.."
# The committed .npy fixtures are numpy's own output: regenerate them and compare.
if python3 -c 'import numpy' 2>/dev/null; then
  tmp=$(mktemp -d)
  python3 scripts/fixtures/make_npy.py "$tmp" >/dev/null
  if diff -r -q "$tmp" crates/stoker-data/tests/fixtures/npy >/dev/null; then
    echo "npy fixtures: identical to this numpy's output"
  else
    echo "warning: this numpy ($(python3 -c 'import numpy; print(numpy.__version__)')) writes .npy fixtures that differ from the committed ones"
  fi
  rm -rf "$tmp"
fi
# No machine profile (`stoker plan --calibrate`'s, ~/.config/stoker/profile.toml): a
# developer's own would change what the plans under test say. Tests that use one name it.
export STOKER_PROFILE=off
# Tests that cannot run here say so (stoker_testkit::skip); collect them for the summary.
export STOKER_SKIP_LOG=$(mktemp)
trap 'rm -f "$STOKER_SKIP_LOG"' EXIT
# CI builds once from a clean checkout: incremental state would only cost disk (it was the
# larger half of a test build's target/ before it was turned off here).
export CARGO_INCREMENTAL=0
# MPI tests run `mpirun -n 2` and `-n 4` themselves, each wrapped in `timeout`.
cargo test --workspace 2>&1
# A 2-minute kill-and-resume soak on a generated text: bit-identical to a run never killed
# (the test build's binary: the dev profile is optimized).
STOKER=target/debug/stoker bash scripts/soak.sh 2 --generated 2>&1
# The opt-in `cuda` feature of the loader builds without CUDA (cudarc loads libcuda at run time)
# and, with no driver here, falls back to mlock: prove both.
cargo test -p stoker-data --features cuda --test pin 2>&1
# The opt-in `cuda` feature of candle, stoker-kernels, stoker-train and the binary compiles.
bash scripts/check-cuda.sh --if-available
if [ -s "$STOKER_SKIP_LOG" ]; then
  echo "== tests that did not run their check on this machine:"
  sort -u "$STOKER_SKIP_LOG"
else
  echo "== every test ran its check (none skipped)"
fi
