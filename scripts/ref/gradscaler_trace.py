#!/usr/bin/env python3
"""Records torch.amp.GradScaler ("cpu") traces for stoker-precision's loss-scaler test.

For each configuration, a one-element parameter is driven for many steps: each step its gradient
is set to a finite value (F), +inf (I) or NaN (N) following a seeded pattern of segments (long
finite runs that trigger growth, short runs, inf/NaN bursts); then scaler.unscale_(opt),
scaler.step(opt), scaler.update(). Recorded per step: the scale after update (f32 bits), the scaled loss
scaler.scale(1.5) (f32 bits) and whether optimizer.step actually ran. Written to
crates/stoker-precision/tests/data/gradscaler_trace.json.gz; read by tests/scaler_torch.rs.

Run: python3 scripts/ref/gradscaler_trace.py   (needs torch)
"""
import gzip
import json
import os
import random
import struct
import sys

import torch


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def pattern(seed: int, steps: int, long_runs: tuple, short_max: int) -> str:
    """Finite runs (some long, length from `long_runs`) separated by inf/NaN bursts of 1-6."""
    rng = random.Random(seed)
    out = []
    while len(out) < steps:
        if rng.random() < 0.35:
            run = rng.randint(*long_runs)
        else:
            run = rng.randint(0, short_max)
        out += ["F"] * run
        burst = rng.choice([1, 1, 1, 2, 3, 6])
        out += [rng.choice("IIIN") for _ in range(burst)]
    return "".join(out[:steps])


def run(name: str, grads: str, **cfg) -> dict:
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    ran = []
    inner = opt.step

    def counting_step(*a, **k):
        ran[-1] = True
        return inner(*a, **k)

    opt.step = counting_step
    scaler = torch.amp.GradScaler("cpu", **cfg)
    scale_after = []
    stepped = []
    scaled_loss = []
    value = {"F": 3.0, "I": float("inf"), "N": float("nan")}
    for g in grads:
        ran.append(False)
        scaled_loss.append(f32_bits(scaler.scale(torch.tensor(1.5)).item()))
        p.grad = torch.full((1,), value[g])
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        scale_after.append(f32_bits(scaler.get_scale()))
        stepped.append("1" if ran[-1] else "0")
    sd = scaler.state_dict()
    return {
        "name": name,
        "init_scale": cfg.get("init_scale", 2.0**16),
        "growth_factor": cfg.get("growth_factor", 2.0),
        "backoff_factor": cfg.get("backoff_factor", 0.5),
        "growth_interval": cfg.get("growth_interval", 2000),
        "grads": grads,
        "scale_after_bits": scale_after,
        "stepped": "".join(stepped),
        "scaled_loss_bits": scaled_loss,
        "final_scale_bits": f32_bits(sd["scale"]),
        "final_growth_tracker": int(sd["_growth_tracker"]),
    }


def main() -> None:
    runs = [
        # torch defaults; runs of 2000-4500 finite steps grow the scale.
        run("default", pattern(1, 24000, (2000, 4500), 40)),
        # growth_interval 100: many growth events.
        run("interval100", pattern(2, 8000, (100, 700), 30), growth_interval=100),
        # factors that are not powers of two: checks the f32 arithmetic of the update.
        run("odd_factors", pattern(3, 4000, (50, 400), 20),
            init_scale=1000.0, growth_factor=3.0, backoff_factor=0.3, growth_interval=50),
        # growth would overflow f32: torch keeps the scale when scale * growth is inf.
        run("growth_to_inf", "F" * 400 + "I" + "F" * 200, init_scale=2.0**120, growth_interval=10),
        # a long inf run drives the scale through the subnormals to zero (torch has no floor).
        run("collapse_to_zero", "I" * 170 + "F" * 60 + "N" * 3 + "F" * 40, growth_interval=10),
    ]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = os.path.join(root, "crates/stoker-precision/tests/data/gradscaler_trace.json.gz")
    doc = {"torch_version": torch.__version__, "runs": runs}
    with open(out, "wb") as f:
        f.write(gzip.compress(json.dumps(doc, separators=(",", ":")).encode(), 9, mtime=0))
    for r in runs:
        print(f"{r['name']}: {len(r['grads'])} steps, {r['stepped'].count('0')} skipped, "
              f"{len(set(r['scale_after_bits']))} distinct scales", file=sys.stderr)
    print(f"{out}: {os.path.getsize(out)} bytes; torch {torch.__version__}", file=sys.stderr)


if __name__ == "__main__":
    main()
