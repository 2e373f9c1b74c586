#!/usr/bin/env python3
"""Writes a document corpus for `make bench-prepare`: Shakespeare's plays cut into documents
of web-like sizes (log-normal, median ~2.5 KB, a long tail), shuffled with a seed, repeated
until TARGET_MB of text, as Parquet shards (snappy, 4 MB row groups: what the Hugging Face
hub serves) and as one JSON Lines file. Usage: prepare_corpus.py TEXTS_DIR OUT_DIR TARGET_MB
"""
import json
import pathlib
import random
import sys

import pyarrow as pa
import pyarrow.parquet as pq


def main():
    texts, out, target_mb = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), float(sys.argv[3])
    words = []
    for p in sorted(texts.glob("*_gut.txt")):
        words.extend(p.read_text(encoding="utf-8", errors="replace").split(" "))
    rng = random.Random(1337)
    docs, size, at = [], 0, 0
    while size < target_mb * 1e6:
        n = max(20, int(rng.lognormvariate(6.0, 1.0)))  # words: median ~400 (~2.5 KB)
        if at + n > len(words):
            at = rng.randrange(0, len(words) // 2)
        doc = " ".join(words[at:at + n])
        at += n
        docs.append(doc)
        size += len(doc.encode("utf-8"))
    rng.shuffle(docs)
    out.mkdir(parents=True, exist_ok=True)
    shards = 4
    per = (len(docs) + shards - 1) // shards
    for s in range(shards):
        part = docs[s * per:(s + 1) * per]
        table = pa.table({"id": list(range(s * per, s * per + len(part))), "text": part})
        pq.write_table(table, out / f"train-{s:05d}-of-{shards:05d}.parquet",
                       row_group_size=1500, compression="snappy")
    with open(out.parent / (out.name + ".jsonl"), "w", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, "text": d}) + "\n")
    print(f"{len(docs)} documents, {size / 1e6:.1f} MB of text, {shards} Parquet shards in {out}")


if __name__ == "__main__":
    main()
