#!/usr/bin/env bash
# Collective bus bandwidth of issue #11 (make bench-comm): stoker's communicator against the
# same MPI call made directly in the same run, 2 ranks, 4 KiB to 256 MiB.
# Usage: bash scripts/bench/comm.sh [extra stoker bench comm flags]
set -euo pipefail
cd "$(dirname "$0")/../.."
echo "== $(date -u +%FT%TZ) $(nproc) cores; $(mpirun --version | sed -n 2p | xargs)"
timeout 1200 mpirun -n 2 target/release/stoker bench comm "$@"
