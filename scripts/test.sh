#!/usr/bin/env bash
# The test suite, as CI runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace 2>&1
