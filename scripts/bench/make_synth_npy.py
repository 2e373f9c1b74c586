"""Writes a synthetic image dataset as numpy itself does: PREFIX.image.npy (f32, N x 3 x 64 x 64)
and PREFIX.label.npy (i64, N), for the loader benchmark. Usage: make_synth_npy.py PREFIX [N]"""
import os
import sys

import numpy as np
from numpy.lib import format as npf

prefix = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 50_000
os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
rng = np.random.default_rng(0)
img = npf.open_memmap(prefix + ".image.npy", mode="w+", dtype=np.float32, shape=(n, 3, 64, 64))
for s in range(0, n, 1000):
    e = min(n, s + 1000)
    img[s:e] = rng.standard_normal((e - s, 3, 64, 64), dtype=np.float32)
img.flush()
del img
np.save(prefix + ".label.npy", rng.integers(0, 1000, size=n, dtype=np.int64))
print(f"wrote {prefix}.image.npy ({n} x 3x64x64 f32) and {prefix}.label.npy")
