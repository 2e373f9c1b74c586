#!/usr/bin/env python3
"""The baseline for the GPU check: the demo's GPT (scripts/bench/step.py's model, the same
architecture and parameter count as configs/shakespeare-gpt.toml) trained on the GPU by
PyTorch as a user would: the whole model and AdamW (fused) on the device, fp32 and bf16
autocast. Prints the median step time of each over timed steps after warm-up, each step
synchronized.

    python3 scripts/gpu/torch_step.py [--steps 40] [--warmup 5]
"""
import argparse
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
from step import Gpt  # noqa: E402


def step_times(precision, a):
    torch.manual_seed(0)
    dev = torch.device("cuda")
    m = Gpt(a.vocab, a.context, a.d_model, a.layers, a.heads).to(dev)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.99), fused=True)
    times = []
    for s in range(a.warmup + a.steps):
        x = torch.randint(0, a.vocab, (a.batch, a.context), device=dev)
        y = torch.randint(0, a.vocab, (a.batch, a.context), device=dev)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = m(x)
        loss = F.cross_entropy(logits.float().view(-1, a.vocab), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        torch.cuda.synchronize()
        if s >= a.warmup:
            times.append(time.perf_counter() - t0)
    return sum(p.numel() for p in m.parameters()), statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    for k, v in [("batch", 16), ("context", 128), ("d_model", 128), ("layers", 4), ("heads", 4),
                 ("vocab", 96), ("steps", 40), ("warmup", 5)]:
        p.add_argument("--" + k.replace("_", "-"), dest=k, type=int, default=v)
    a = p.parse_args()
    for prec in ("fp32", "bf16"):
        n, t = step_times(prec, a)
        print(f"torch {torch.__version__} {torch.cuda.get_device_name()} {prec}: {n:,} params, "
              f"median step {t * 1e3:.2f} ms over {a.steps} steps")


if __name__ == "__main__":
    main()
