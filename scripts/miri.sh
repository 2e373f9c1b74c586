#!/usr/bin/env bash
# Miri over the pure-Rust unit tests that exercise stoker's own `unsafe` code paths
# (docs/reliability.md): the embedding scatter, stoker-precision's conversions and
# overflow scans, stoker-data's page-aligned batch buffers, and the planner (pure Rust).
# Needs a nightly toolchain with Miri (installed here with rustup; says so and stops if it
# cannot be). Tree borrows: rayon's crossbeam-epoch breaks stacked
# borrows' rules in ways tree borrows accepts; ignore-leaks: rayon's global pool never
# joins its threads. The largest tests are skipped (Miri runs them at about 1/1000 speed).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! rustup toolchain install nightly --profile minimal --component miri >/dev/null 2>&1; then
  echo "miri: SKIPPED: no nightly toolchain with Miri could be installed here" >&2
  exit 0
fi
export MIRIFLAGS="-Zmiri-tree-borrows -Zmiri-ignore-leaks"
cargo +nightly miri test -p stoker-kernels --lib scatter_tests
cargo +nightly miri test -p stoker-precision --lib -- --skip parallel_equals_serial
cargo +nightly miri test -p stoker-data --lib host_buffers
cargo +nightly miri test -p stoker-plan --lib
