#!/usr/bin/env bash
# JPEG pipeline benchmark: stoker (pack, then decode + RRC 224 + flip + normalize on 1 and 2
# threads) against torchvision transforms in a DataLoader (num_workers 0, 1, 2; best), on the
# same photos, in the same run. Prints both, the ratio, and peak RSS of each side.
# Usage: bash scripts/bench/jpeg.sh [DIR] [--limit N]   (DIR defaults to data/photos-3k)
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR="${1:-data/photos-3k}"
shift || true
[ -d "$DIR" ] || bash scripts/fetch-photos.sh
cargo build -q --release -p stoker-data --example bench_jpeg
BIN=target/release/examples/bench_jpeg
LOG="$(mktemp -d)"
trap 'rm -rf "$LOG"' EXIT
timed() { /usr/bin/time -v -o "$1" "${@:2}"; }
rss() { awk -F': ' '/Maximum resident set size/ {printf "%.0f MiB", $2 / 1024}' "$1"; }

echo "== stoker ($DIR)"
timed "$LOG/stoker.time" "$BIN" "$DIR" --threads 1,2 "$@" | tee "$LOG/stoker.out"
echo "   peak RSS: $(rss "$LOG/stoker.time")"
echo "== torchvision ($DIR)"
timed "$LOG/tv.time" python3 scripts/bench/torchvision_jpeg.py "$DIR" --workers 0,1,2 "$@" | tee "$LOG/tv.out"
echo "   peak RSS (main process; workers not included): $(rss "$LOG/tv.time")"

rate() { grep "$2" "$1" | sed -E 's/.*images_per_s=([0-9.]+).*/\1/' | head -1; }
s1=$(rate "$LOG/stoker.out" "threads=1 ")
s2=$(rate "$LOG/stoker.out" "threads=2 ")
tv=$(rate "$LOG/tv.out" "^BEST")
echo "== summary: stoker 1 thread ${s1}/s, 2 threads ${s2}/s; torchvision best ${tv}/s"
python3 -c "print(f'ratio stoker(2 threads) / torchvision(best) = {$s2 / $tv:.2f}x; stoker(1 thread) / torchvision(best) = {$s1 / $tv:.2f}x')"
