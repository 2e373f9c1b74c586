#!/usr/bin/env bash
# JPEG pipeline benchmark: stoker (pack, then decode + RRC 224 + flip + normalize on 1 and 2
# threads) against torchvision transforms in a DataLoader (num_workers 0, 1, 2; best), on the
# same photos, in the same run. Prints both, the ratio, and peak RSS of each side.
#   Part A, same bytes: both decode the original photos.
#   Part A also runs stoker with the earlier decoder (zune-jpeg, full size; 2 threads) to show
#   what libjpeg-turbo and its DCT-domain scaling contribute.
#   Part B, FFCV-style: stoker packs with --max-side 512 (shrunk, re-encoded at quality 90) and
#   exports those records as a folder, which torchvision then reads: again the same bytes.
# Usage: bash scripts/bench/jpeg.sh [DIR] [--limit N]   (DIR defaults to data/photos-3k)
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR="${1:-data/photos-3k}"
shift || true
[ -d "$DIR" ] || bash scripts/fetch-photos.sh
cargo build -q --release -p stoker-data --example bench_jpeg
BIN=target/release/examples/bench_jpeg
LOG="$(mktemp -d)"
SMALL="$DIR-512"
trap 'rm -rf "$LOG" "$SMALL"' EXIT
timed() { /usr/bin/time -v -o "$1" "${@:2}"; }
rss() { awk -F': ' '/Maximum resident set size/ {printf "%.0f MiB", $2 / 1024}' "$1"; }
rate() { grep "$2" "$1" | sed -E 's/.*images_per_s=([0-9.]+).*/\1/' | head -1; }
ratio() { python3 -c "print(f'{$1 / $2:.2f}x')"; }

part() { # NAME STOKER_ARGS...
  local name="$1"; shift
  echo "== [$name] stoker"
  timed "$LOG/$name.s.time" "$BIN" "$@" | tee "$LOG/$name.s.out"
  echo "   peak RSS: $(rss "$LOG/$name.s.time")"
}
baseline() { # NAME DIR
  echo "== [$1] torchvision ($2)"
  timed "$LOG/$1.t.time" python3 scripts/bench/torchvision_jpeg.py "$2" --workers 0,1,2 "${EXTRA[@]}" | tee "$LOG/$1.t.out"
  echo "   peak RSS (largest single process): $(rss "$LOG/$1.t.time")"
}
summary() {
  local s1 s2 tv
  s1=$(rate "$LOG/$1.s.out" "threads=1 "); s2=$(rate "$LOG/$1.s.out" "threads=2 "); tv=$(rate "$LOG/$1.t.out" "^BEST")
  echo "== [$1] stoker 1 thread ${s1}/s, 2 threads ${s2}/s; torchvision best ${tv}/s;" \
    "ratio 2 threads/torchvision $(ratio "$s2" "$tv"), 1 thread/torchvision $(ratio "$s1" "$tv")"
}

EXTRA=("$@")
part original "$DIR" --threads 1,2 "$@"
part original-zune "$DIR" --threads 2 --decoder zune "$@"
baseline original "$DIR"
rm -rf "$SMALL"
part max512 "$DIR" --threads 1,2 --max-side 512 --export "$SMALL" "$@"
baseline max512 "$SMALL"
summary original
echo "== [original] stoker with zune-jpeg (full-size decode), 2 threads: $(rate "$LOG/original-zune.s.out" "threads=2 ")/s"
summary max512
