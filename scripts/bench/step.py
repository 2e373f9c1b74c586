#!/usr/bin/env python3
"""Training step time of the same GPT in stoker and in PyTorch CPU eager, side by side.

Same architecture (token + position embeddings, pre-LayerNorm blocks, causal multi-head
attention, GELU (tanh) MLP, tied head), same parameter count, batch, context, AdamW with
weight decay and global-norm clipping; both on 2 threads. Reports the median step time of
each and stoker / PyTorch; then stoker's tokens/s in fp32 vs bf16, and the direct step
(the default) against the fused ops on candle's autograd graph.

    python3 scripts/bench/step.py [--steps 10] [--threads 2] [--rounds 3]
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[2]


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.fc_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / (d // self.h) ** 0.5
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, vocab, context, d, layers, heads):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.ln_f(x) @ self.wte.weight.t()


def torch_step_times(a):
    torch.manual_seed(0)
    m = Gpt(a.vocab, a.context, a.d_model, a.layers, a.heads)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1)
    times = []
    for s in range(2 + a.steps):
        x = torch.randint(0, a.vocab, (a.batch, a.context))
        y = torch.randint(0, a.vocab, (a.batch, a.context))
        t0 = time.perf_counter()
        loss = F.cross_entropy(m(x).view(-1, a.vocab), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        if s >= 2:
            times.append(time.perf_counter() - t0)
    return sum(p.numel() for p in m.parameters()), times


def stoker(a, precision, kernels="direct"):
    exe = ROOT / "target/release/examples/step_bench"
    args = [precision, a.batch, a.context, a.d_model, a.layers, a.heads, a.vocab, a.steps, kernels]
    env = dict(os.environ, RAYON_NUM_THREADS=str(a.threads))
    out = subprocess.run([str(exe), *map(str, args)], check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser()
    for k, v in [("batch", 16), ("context", 128), ("d_model", 128), ("layers", 4), ("heads", 4),
                 ("vocab", 96), ("steps", 10), ("threads", 2), ("rounds", 3)]:
        p.add_argument("--" + k.replace("_", "-"), dest=k, type=int, default=v)
    a = p.parse_args()
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "stoker-train", "--example", "step_bench"],
                   cwd=ROOT, check=True)
    torch.set_num_threads(a.threads)
    # Rounds alternate the four runs, so drift of a shared machine hits them alike; each
    # figure is the median over every round's timed steps.
    runs = {"torch": [], "fp32": [], "bf16": [], "fused": []}
    for _ in range(a.rounds):
        n_torch, t = torch_step_times(a)
        runs["torch"] += t
        for key, prec, kern in [("fp32", "fp32", "direct"), ("bf16", "bf16", "direct"),
                                ("fused", "fp32", "fused")]:
            r = stoker(a, prec, kern)
            n_stoker = r["params"]
            runs[key] += r["step_s"]
    med = {k: statistics.median(v) for k, v in runs.items()}
    tok = a.batch * a.context
    print(f"GPT {n_torch:,} params (stoker {n_stoker:,}), batch {a.batch}, context {a.context}, "
          f"{a.threads} threads, median of {a.rounds} alternating rounds x {a.steps} steps")
    print(f"PyTorch {torch.__version__} eager fp32: {1e3 * med['torch']:8.1f} ms/step  {tok / med['torch']:8.0f} tokens/s")
    print(f"stoker fp32:               {1e3 * med['fp32']:8.1f} ms/step  {tok / med['fp32']:8.0f} tokens/s")
    print(f"stoker bf16:               {1e3 * med['bf16']:8.1f} ms/step  {tok / med['bf16']:8.0f} tokens/s")
    print(f"stoker fp32, fused ops on candle's graph (kernels = \"fused\"): "
          f"{1e3 * med['fused']:8.1f} ms/step, direct step {med['fused'] / med['fp32']:.2f}x faster")
    print(f"ratio stoker fp32 / PyTorch: {med['fp32'] / med['torch']:.2f}x step time")
    print(f"stoker bf16 / fp32 tokens/s: {med['fp32'] / med['bf16']:.2f}")


if __name__ == "__main__":
    main()
