#!/usr/bin/env python3
"""Reference vectors for stoker-precision's FP8 / bf16 / f16 conversions, from ml_dtypes.

Writes crates/stoker-precision/tests/data/fp8_vectors.bin.gz (gzip of the layout below, all
little-endian). The Rust test `tests/fp8_reference.rs` reads it back and compares bit for bit.

Inputs, in order:
  1. structured: every FP8 value of both formats, every tie point between adjacent FP8 values,
     the ties beyond the max finite value, each with its f32 neighbours (+-1, +-2 ulp), both
     signs; powers of two over the whole f32 range with neighbours; f32 subnormals; specials
     (+-0, +-inf, quiet and signalling NaNs with payloads). Stored in the file.
  2. N_RAND_BITS f32 from random bits: splitmix64(SEED) stream, bits = (z >> 32). Not stored:
     the test regenerates them with the same splitmix64.
  3. N_RAND_RANGE f32 in the FP8-relevant range [2^-28, 2^22): continuing the same stream,
     z -> sign = z >> 63, exponent = 99 + (z >> 32) % 50, mantissa = z & 0x7fffff. Not stored.

Outputs (one per input): float8_e4m3fn and float8_e5m2 with ml_dtypes' astype (the
non-saturating reference: overflow -> NaN for e4m3fn, +-inf for e5m2), and the saturating mode,
defined as astype(clip(x, -max, max)) with NaN left NaN (so +-inf -> +-max), which is what CUDA's
__NV_SATFINITE conversion (used by Transformer Engine's casts) does. For the structured inputs
also bfloat16 (ml_dtypes) and float16 (numpy) bits. Finally the f32 bits of all 256 patterns of
each FP8 format decoded by ml_dtypes.

Layout: b"STKF8V01", u64 seed, u32 n_struct, u32 n_rand_bits, u32 n_rand_range,
f32[n_struct] structured inputs, u8[N] e4m3fn, u8[N] e4m3fn_sat, u8[N] e5m2, u8[N] e5m2_sat
(N = n_struct + n_rand_bits + n_rand_range), u16[n_struct] bf16, u16[n_struct] f16,
u32[256] e4m3fn decoded, u32[256] e5m2 decoded.

Run: python3 scripts/ref/fp8_vectors.py   (needs numpy and ml_dtypes from PyPI)
"""
import gzip
import os
import struct
import sys

import ml_dtypes
import numpy as np

SEED = 0x5EED_F8F8_2026_0001
N_RAND_BITS = 1 << 20
N_RAND_RANGE = 1 << 17
M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def splitmix64(seed: int, n: int, start: int = 0) -> np.ndarray:
    """Outputs start..start+n of splitmix64 seeded with `seed` (state += gamma before mixing)."""
    with np.errstate(over="ignore"):
        i = np.arange(start + 1, start + n + 1, dtype=np.uint64)
        z = np.uint64(seed) + i * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def f32_from_bits(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def neighbours(x: np.ndarray, k: int = 2) -> np.ndarray:
    """x and its f32 neighbours up to k ulps on either side, both signs."""
    out = [x]
    up, down = x.copy(), x.copy()
    for _ in range(k):
        up = np.nextafter(up, np.float32(np.inf))
        down = np.nextafter(down, np.float32(-np.inf))
        out += [up, down]
    a = np.concatenate(out)
    return np.concatenate([a, -a])


def structured() -> np.ndarray:
    parts = []
    for t, beyond in ((ml_dtypes.float8_e4m3fn, 480.0), (ml_dtypes.float8_e5m2, 65536.0)):
        vals = np.arange(256, dtype=np.uint8).view(t).astype(np.float32)
        v = np.unique(np.abs(vals[np.isfinite(vals)]))
        v = np.append(v, np.float32(beyond))  # the value just beyond max finite
        mids = ((v[:-1].astype(np.float64) + v[1:]) / 2).astype(np.float32)
        assert np.all(mids.astype(np.float64) == (v[:-1].astype(np.float64) + v[1:]) / 2)
        parts += [neighbours(v), neighbours(mids), neighbours(v * np.float32(4)), neighbours(v / 4)]
    pow2 = np.ldexp(np.float32(1), np.arange(-149, 128)).astype(np.float32)
    parts.append(neighbours(pow2, 1))
    specials = [
        0x00000000, 0x80000000, 0x7F800000, 0xFF800000,  # zeros, infinities
        0x7FC00000, 0xFFC00000, 0x7FC00001, 0x7FFFFFFF, 0xFFFFFFFF,  # quiet NaNs
        0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7FA00000, 0x7F900000,  # signalling NaNs
        0x7FE00000, 0x7FD00000, 0xFFE12345,
        0x00000001, 0x80000001, 0x00400000, 0x007FFFFF, 0x807FFFFF,  # f32 subnormals
        0x00800000, 0x7F7FFFFF, 0xFF7FFFFF,  # f32 min normal, max
    ]
    parts.append(f32_from_bits(specials))
    return np.concatenate(parts).astype(np.float32)


def random_inputs() -> np.ndarray:
    z = splitmix64(SEED, N_RAND_BITS + N_RAND_RANGE)
    a = (z[:N_RAND_BITS] >> np.uint64(32)).astype(np.uint32)
    zb = z[N_RAND_BITS:]
    sign = (zb >> np.uint64(63)).astype(np.uint32) << np.uint32(31)
    exp = (np.uint64(99) + (zb >> np.uint64(32)) % np.uint64(50)).astype(np.uint32) << np.uint32(23)
    mant = (zb & np.uint64(0x7FFFFF)).astype(np.uint32)
    b = sign | exp | mant
    return np.concatenate([f32_from_bits(a), f32_from_bits(b)])


def fp8(x: np.ndarray, t, saturate: bool) -> np.ndarray:
    if saturate:
        m = np.float32(float(ml_dtypes.finfo(t).max))
        with np.errstate(invalid="ignore"):
            x = np.where(np.isnan(x), x, np.clip(x, -m, m)).astype(np.float32)
    return x.astype(t).view(np.uint8)


def main() -> None:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = os.path.join(root, "crates/stoker-precision/tests/data/fp8_vectors.bin.gz")
    s = structured()
    x = np.concatenate([s, random_inputs()])
    blob = [b"STKF8V01", struct.pack("<QIII", SEED, len(s), N_RAND_BITS, N_RAND_RANGE), s.tobytes()]
    for t in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2):
        for sat in (False, True):
            blob.append(fp8(x, t, sat).tobytes())
    with np.errstate(over="ignore", invalid="ignore"):
        blob.append(s.astype(ml_dtypes.bfloat16).view(np.uint16).tobytes())
        blob.append(s.astype(np.float16).view(np.uint16).tobytes())
    for t in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2):
        blob.append(np.arange(256, dtype=np.uint8).view(t).astype(np.float32).view(np.uint32).tobytes())
    data = b"".join(blob)
    with open(out, "wb") as f:
        # mtime=0 keeps the file byte-identical across runs.
        f.write(gzip.compress(data, compresslevel=9, mtime=0))
    print(f"{out}: {len(x)} inputs ({len(s)} structured), {len(data)} bytes raw, "
          f"{os.path.getsize(out)} gzipped; numpy {np.__version__}, ml_dtypes {ml_dtypes.__version__}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
