"""PyTorch's time for the operations stoker's GPU kernels do, at GPT-2 124M's shapes
(bf16, micro-batch B x 1024, d_model 768, 12 heads, vocabulary 50,304 padded), median of
REPS launches timed with CUDA events: the baseline scripts/gpu/kernels-check.sh prints
beside `stoker bench gpu-kernels`. Eager ops, and torch.compile of the same function
where fusion is what a user would get. `--device cpu --batch 1 --t 64` runs it anywhere
(a smoke test of the script, not a measurement)."""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=16)
p.add_argument("--t", type=int, default=1024)
p.add_argument("--reps", type=int, default=20)
p.add_argument("--device", default="cuda")
p.add_argument("--no-compile", action="store_true")
a = p.parse_args()
dev = torch.device(a.device)
B, T, C, H, V = a.batch, a.t, 768, 12, 50304
N = B * T
bf = torch.bfloat16
params = 124_475_904


def timed(fn):
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(a.reps):
        if dev.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


x = torch.randn(N, C, device=dev, dtype=bf)
a2 = torch.randn(N, C, device=dev, dtype=bf)
w = torch.ones(C, device=dev, dtype=bf, requires_grad=True)
b = torch.zeros(C, device=dev, dtype=bf, requires_grad=True)
fc = torch.randn(N, 4 * C, device=dev, dtype=bf, requires_grad=True)
att_in = torch.randn(B, H, T, T, device=dev, dtype=bf, requires_grad=True)
mask = torch.ones(T, T, device=dev, dtype=torch.bool).tril()
logits = torch.randn(N, V, device=dev, dtype=bf, requires_grad=True)
targets = torch.randint(0, 50257, (N,), device=dev)
qkv = torch.randn(B, T, 3, H, C // H, device=dev, dtype=bf)
wte = torch.randn(V, C, device=dev, dtype=bf)
wpe = torch.randn(T, C, device=dev, dtype=bf)
tokens = torch.randint(0, 50257, (B, T), device=dev)


def ln_fwd():
    r = x + a2
    return F.layer_norm(r, (C,), w, b, 1e-5)


xr = (x + a2).requires_grad_(True)
ln_out = F.layer_norm(xr, (C,), w, b, 1e-5)
g_ln = torch.randn_like(ln_out)
g_fc = torch.randn_like(fc)
gelu_out = F.gelu(fc, approximate="tanh")
att_out = att_in.masked_fill(~mask, float("-inf")).softmax(-1)
g_att = torch.randn_like(att_out)

# Causal attention as PyTorch runs it fused (SDPA: FlashAttention-2 or cuDNN on a GPU),
# beside stoker's flash kernels.
sq, sk, sv = (torch.randn(B, H, T, C // H, device=dev, dtype=bf, requires_grad=True) for _ in range(3))
sdpa_out = F.scaled_dot_product_attention(sq, sk, sv, is_causal=True)
g_sdpa = torch.randn_like(sdpa_out)

ps = [torch.zeros(params, device=dev, dtype=torch.float32, requires_grad=True)]
ps[0].grad = torch.randn_like(ps[0]) * 1e-3
opt = torch.optim.AdamW(ps, lr=3e-4, fused=dev.type == "cuda")

ops = [
    ("encoder-forward", lambda: wte[tokens] + wpe),
    ("layernorm-forward (residual fused)", ln_fwd),
    ("layernorm-backward", lambda: torch.autograd.grad(ln_out, (xr, w, b), g_ln, retain_graph=True)),
    ("gelu-forward", lambda: F.gelu(fc, approximate="tanh")),
    ("gelu-backward", lambda: torch.autograd.grad(gelu_out, fc, g_fc, retain_graph=True)),
    ("qkv-heads", lambda: qkv.permute(2, 0, 3, 1, 4).contiguous()),
    ("attention-softmax-forward", lambda: (att_in * 0.125).masked_fill(~mask, float("-inf")).softmax(-1)),
    ("attention-softmax-backward", lambda: torch.autograd.grad(att_out, att_in, g_att, retain_graph=True)),
    ("classifier (cross-entropy fwd+bwd)", lambda: torch.autograd.grad(F.cross_entropy(logits.float(), targets), logits)),
    ("column-sums (qkv bias)", lambda: qkv.view(N, 3 * C).float().sum(0)),
    ("adamw (124M, fused)", lambda: opt.step()),
    ("flash-forward (sdpa, causal)", lambda: F.scaled_dot_product_attention(sq, sk, sv, is_causal=True)),
    ("flash-backward (sdpa, causal)", lambda: torch.autograd.grad(sdpa_out, (sq, sk, sv), g_sdpa, retain_graph=True)),
]
name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
print(f"pytorch {torch.__version__} on {name}: the same operations, bf16, micro-batch {B} x {T} (median of {a.reps}, us)")
compiled = not a.no_compile and dev.type == "cuda"
print(f"{'operation':<38} {'eager':>10} {'compiled':>10}")
for label, fn in ops:
    eager = timed(fn)
    comp = "n/a"
    if compiled and not label.startswith("adamw"):
        try:
            comp = f"{timed(torch.compile(fn)):.1f}"
        except Exception as e:  # a compile failure is a result, not a crash
            comp = f"failed ({type(e).__name__})"
    print(f"{label:<38} {eager:>10.1f} {comp:>10}")
