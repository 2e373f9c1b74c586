#!/usr/bin/env bash
# Fetches real photos for the JPEG pipeline benchmark through the ordinary package clients:
#   data/photos/skimage/*.jpg  from the scikit-image wheel (skimage/data)
#   data/photos/sklearn/*.jpg  from the scikit-learn wheel (sklearn/datasets/images)
#   data/photos/mate/*.jpg     from Debian's mate-backgrounds
# then replicates them to about N (default 3000) files under data/photos-3k/<class>/ by hard links
# with distinct names (no extra disk); a second argument picks another folder. Nothing here is
# committed (data/ is git-ignored). Usage: bash scripts/fetch-photos.sh [N] [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
N="${1:-3000}"
OUT=data/photos
REP="${2:-data/photos-3k}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$OUT"/{skimage,sklearn,mate}

if [ -z "$(ls -A "$OUT/skimage")" ]; then
  python3 -m pip download -q --no-deps scikit-image -d "$TMP/skimage"
  unzip -q -j -o "$TMP"/skimage/scikit_image-*.whl 'skimage/data/*.jpg' -d "$OUT/skimage"
fi
if [ -z "$(ls -A "$OUT/sklearn")" ]; then
  python3 -m pip download -q --no-deps scikit-learn -d "$TMP/sklearn"
  unzip -q -j -o "$TMP"/sklearn/scikit_learn-*.whl 'sklearn/datasets/images/*.jpg' -d "$OUT/sklearn"
fi
if [ -z "$(ls -A "$OUT/mate")" ]; then
  if ! apt-cache show mate-backgrounds >/dev/null 2>&1; then apt-get update -qq; fi
  (cd "$TMP" && apt-get download -q mate-backgrounds >/dev/null)
  dpkg -x "$TMP"/mate-backgrounds_*.deb "$TMP/mate"
  find "$TMP/mate" -type f \( -iname '*.jpg' -o -iname '*.jpeg' \) -exec cp {} "$OUT/mate/" \;
fi

# Replicate: round-robin over every source photo until N files exist, keeping its class.
rm -rf "$REP"
mapfile -t files < <(find "$OUT" -type f -iname '*.jp*g' | sort)
[ "${#files[@]}" -gt 0 ] || { echo "error: no photos found under $OUT" >&2; exit 1; }
for ((i = 0; i < N; i++)); do
  src="${files[i % ${#files[@]}]}"
  class="$(basename "$(dirname "$src")")"
  mkdir -p "$REP/$class"
  ln -f "$src" "$REP/$class/$(printf '%05d' "$i")_$(basename "$src")"
done
echo "photos: ${#files[@]} originals in $OUT ($(du -sh "$OUT" | cut -f1)); $N files in $REP"
for d in "$OUT"/*; do echo "  $(basename "$d"): $(ls "$d" | wc -l) files"; done
