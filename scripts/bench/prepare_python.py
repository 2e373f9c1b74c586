#!/usr/bin/env python3
"""The Python recipes `make bench-prepare` measures stoker against, on the same Parquet
shards, each writing the concatenated token ids (uint16, every document's GPT-2 tokens then
<|endoftext|>) to OUT for the identity check:
  single    nanoGPT's prepare.py: tiktoken's encode_ordinary over the rows in one process;
  datasets  llm.c's fineweb.py shape: datasets' Parquet loader and .map(num_proc=CORES)
            with tiktoken (a pool of processes).
Prints one line: recipe, seconds, MB/s of text in, tokens/s out.
GPT-2's ranks come from R50K (tiktoken-rs's copy of r50k_base.tiktoken, the file tiktoken
downloads; this machine reaches no other host), with tiktoken's own gpt2 pattern.
Usage: R50K=PATH prepare_python.py single|datasets PARQUET_DIR OUT [CORES]
"""
import glob
import os
import sys
import time

import numpy as np
import tiktoken


def gpt2():
    """tiktoken's gpt2 encoding (tiktoken_ext.openai_public.gpt2) from the local ranks."""
    from tiktoken.load import load_tiktoken_bpe
    ranks = load_tiktoken_bpe(os.environ["R50K"])
    return tiktoken.Encoding(
        name="gpt2",
        explicit_n_vocab=50257,
        pat_str=r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": 50256},
    )


def main():
    recipe, src, out = sys.argv[1], sys.argv[2], sys.argv[3]
    cores = int(sys.argv[4]) if len(sys.argv) > 4 else os.cpu_count()
    files = sorted(glob.glob(os.path.join(src, "*.parquet")))
    enc = gpt2()
    eot = enc.eot_token
    t0 = time.perf_counter()
    if recipe == "single":
        import pyarrow.parquet as pq
        parts, text_bytes = [], 0
        for f in files:
            for batch in pq.ParquetFile(f).iter_batches(columns=["text"]):
                for doc in batch.column(0).to_pylist():
                    text_bytes += len(doc.encode("utf-8"))
                    ids = enc.encode_ordinary(doc)
                    ids.append(eot)
                    parts.append(np.array(ids, dtype=np.uint16))
        tokens = np.concatenate(parts)
    elif recipe == "datasets":
        import shutil
        import tempfile
        from datasets import disable_caching, load_dataset
        from datasets.utils.logging import disable_progress_bar
        disable_progress_bar()
        disable_caching()
        # A fresh cache every run: nothing a previous run converted or mapped is reused.
        cache = tempfile.mkdtemp(dir=os.path.dirname(out))
        ds = load_dataset("parquet", data_files=files, split="train", cache_dir=cache)

        def tokenize(doc):
            ids = enc.encode_ordinary(doc["text"])
            ids.append(eot)
            return {"ids": ids, "len": len(ids), "bytes": len(doc["text"].encode("utf-8"))}

        tok = ds.map(tokenize, remove_columns=["text", "id"], num_proc=cores,
                     load_from_cache_file=False)
        text_bytes = int(np.sum(tok["bytes"]))
        tokens = np.concatenate([np.array(x, dtype=np.uint16) for x in tok["ids"]])
        shutil.rmtree(cache, ignore_errors=True)
    else:
        raise SystemExit(f"unknown recipe {recipe}")
    secs = time.perf_counter() - t0
    tokens.tofile(out)
    print(f"{recipe}: {secs:.2f} s, {text_bytes / 1e6 / secs:.1f} MB/s in, "
          f"{len(tokens) / secs:.0f} tokens/s out ({len(tokens)} tokens)")


if __name__ == "__main__":
    main()
