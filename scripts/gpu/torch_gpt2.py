"""The baseline for stoker's GPU step: GPT-2 124M (vocabulary 50,304, context 1,024, 12
layers, d_model 768, 12 heads, tied head) in PyTorch as its fastest common recipe runs it:
bf16 autocast, SDPA (flash) attention, torch.compile, fused AdamW. Prints the median time
of the forward + backward alone (what `stoker bench gpu-kernels --step` times today) and
of the whole step with AdamW, with tokens/s and MFU (llm.c's 6N + 6LCT FLOPs per token
over the GPU's dense bf16 peak, 989 TFLOP/s on H100 / H200), for each micro-batch of
`--batch` (one that runs out of GPU memory says so, and the next is still timed).
    python3 scripts/gpu/torch_gpt2.py [--batch 16 [--batch 32 ...]] [--steps 20] [--no-compile]
`--device cpu --batch 1 --t 64 --layers 2` runs it anywhere (a smoke test, not a figure)."""
import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, action="append")
p.add_argument("--t", type=int, default=1024)
p.add_argument("--layers", type=int, default=12)
p.add_argument("--steps", type=int, default=20)
p.add_argument("--warmup", type=int, default=5)
p.add_argument("--device", default="cuda")
p.add_argument("--no-compile", action="store_true")
a = p.parse_args()
batches = a.batch or [16]
V, C, H = 50304, 768, 12
dev = torch.device(a.device)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.fc, self.fc_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(B, T, 3, H, C // H).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class Gpt2(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(a.t, C)
        self.h = nn.ModuleList(Block() for _ in range(a.layers))
        self.ln_f = nn.LayerNorm(C)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.h:
            x = b(x)
        return self.ln_f(x) @ self.wte.weight.T


torch.manual_seed(0)
model = Gpt2().to(dev)
n_params = sum(p.numel() for p in model.parameters())
opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=dev.type == "cuda")
run = model if a.no_compile or dev.type != "cuda" else torch.compile(model, dynamic=False)


def fwd_bwd(x, y):
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        logits = run(x)
    loss = F.cross_entropy(logits.float().view(-1, V), y.view(-1))
    loss.backward()
    return loss


def whole(x, y):
    opt.zero_grad(set_to_none=True)
    fwd_bwd(x, y)
    opt.step()


def median_ms(fn):
    times = []
    for s in range(a.warmup + a.steps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if s >= a.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


flops = 6 * n_params + 6 * a.layers * C * a.t
name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
for batch in batches:
    print(f"pytorch {torch.__version__} on {name}: GPT-2 124M ({n_params:,} parameters), bf16 autocast, SDPA, "
          f"{'eager' if run is model else 'torch.compile'}, micro-batch {batch} x {a.t}")
    x = torch.randint(0, 50257, (batch, a.t), device=dev)
    y = torch.randint(0, 50257, (batch, a.t), device=dev)
    tokens = batch * a.t
    try:
        for label, fn in [("forward+backward", lambda: (model.zero_grad(set_to_none=True), fwd_bwd(x, y))),
                          ("step with fused AdamW", lambda: whole(x, y))]:
            ms = median_ms(fn)
            tps = tokens / (ms / 1e3)
            print(f"{label:<24} {ms:9.2f} ms  {tps:12,.0f} tokens/s  MFU {100 * tps * flops / 989e12:5.1f}%")
        if dev.type == "cuda":
            print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**20:,.0f} MiB (allocated by torch)")
    except torch.OutOfMemoryError:
        print(f"micro-batch {batch}: out of GPU memory")
    model.zero_grad(set_to_none=True)
    del x, y
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
