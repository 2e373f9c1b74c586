#!/usr/bin/env python3
"""Checks a `stoker export hf` directory with transformers itself.

Loads MODEL_DIR with GPT2LMHeadModel.from_pretrained (fp32, eval mode), runs the tokens
of TOKENS (int64 .npy, shape [B, T]) and compares its logits with stoker's (LOGITS, f32
.npy, shape [B*T, V]); prints the largest absolute difference and exits 1 above the
tolerance. Then writes the model back with save_pretrained into SAVE_DIR (transformers'
own safetensors writer), for stoker to import: the round trip.
"""
import argparse
import os
import sys

# transformers 5 loads Hugging Face hub kernels by default (a download and the `kernels`
# package); the check is of the model as written, offline.
os.environ.setdefault("USE_HUB_KERNELS", "0")

import numpy as np
import torch
from transformers import GPT2LMHeadModel


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("tokens")
    ap.add_argument("logits")
    ap.add_argument("save_dir")
    ap.add_argument("--tol", type=float, default=1e-4)
    a = ap.parse_args()
    torch.manual_seed(0)
    m = GPT2LMHeadModel.from_pretrained(a.model_dir, dtype=torch.float32)
    m.eval()
    assert m.lm_head.weight.data_ptr() == m.transformer.wte.weight.data_ptr(), "head not tied"
    tokens = torch.from_numpy(np.load(a.tokens).astype(np.int64))
    want = np.load(a.logits).astype(np.float64)
    with torch.no_grad():
        got = m(input_ids=tokens).logits.reshape(-1, m.config.vocab_size).double().numpy()
    diff = float(np.max(np.abs(got - want)))
    if not np.isfinite(diff):
        print("non-finite logits", file=sys.stderr)
        return 1
    print(f"transformers {__import__('transformers').__version__} vs stoker: max abs logit difference {diff:.3e} "
          f"(tolerance {a.tol:g}, logits up to {np.max(np.abs(want)):.3f})")
    m.save_pretrained(a.save_dir, safe_serialization=True)
    return 0 if diff <= a.tol else 1


if __name__ == "__main__":
    sys.exit(main())
