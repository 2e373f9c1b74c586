#!/usr/bin/env python3
"""Checks a `stoker export hf` Llama directory with transformers itself, both ways.

1. Loads MODEL_DIR with LlamaForCausalLM.from_pretrained (fp32, eval mode, eager
   attention), runs the tokens of TOKENS (int64 .npy, [B, T]) and compares its logits with
   stoker's (LOGITS, f32 .npy, [B*T, V]); prints the largest absolute difference.
2. Writes the model back with save_pretrained into SAVE_DIR, for stoker to import.
3. The other way: a fresh LlamaForCausalLM of the same config, drawn by torch (seed 0),
   saved into FRESH_DIR with its logits on the same tokens (FRESH_DIR/logits.npy), for
   stoker to import and compare.
Exits 1 when step 1's difference is above the tolerance.
"""
import argparse
import os
import sys

# transformers 5 loads Hugging Face hub kernels by default (a download and the `kernels`
# package); the check is of the model as written, offline.
os.environ.setdefault("USE_HUB_KERNELS", "0")

import numpy as np
import torch
import transformers
from transformers import LlamaForCausalLM


def logits(m, tokens):
    with torch.no_grad():
        return m(input_ids=tokens).logits.reshape(-1, m.config.vocab_size).double().numpy()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("tokens")
    ap.add_argument("logits")
    ap.add_argument("save_dir")
    ap.add_argument("fresh_dir")
    ap.add_argument("--tol", type=float, default=1e-4)
    a = ap.parse_args()
    torch.manual_seed(0)
    m = LlamaForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32, attn_implementation="eager")
    m.eval()
    assert m.lm_head.weight.data_ptr() != m.model.embed_tokens.weight.data_ptr(), "head tied"
    tokens = torch.from_numpy(np.load(a.tokens).astype(np.int64))
    want = np.load(a.logits).astype(np.float64)
    got = logits(m, tokens)
    diff = float(np.max(np.abs(got - want)))
    if not np.isfinite(diff):
        print("non-finite logits", file=sys.stderr)
        return 1
    print(f"transformers {transformers.__version__} LlamaForCausalLM vs stoker: max abs logit "
          f"difference {diff:.3e} (tolerance {a.tol:g}, logits up to {np.max(np.abs(want)):.3f})")
    m.save_pretrained(a.save_dir, safe_serialization=True)
    fresh = LlamaForCausalLM(m.config)
    fresh.eval()
    fresh.save_pretrained(a.fresh_dir, safe_serialization=True)
    np.save(f"{a.fresh_dir}/logits.npy", logits(fresh, tokens).astype(np.float32))
    return 0 if diff <= a.tol else 1


if __name__ == "__main__":
    sys.exit(main())
