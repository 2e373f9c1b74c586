"""PyTorch CPU timings of the ops in crates/stoker-kernels/benches/ops.rs, same shapes.

Run: `python3 scripts/bench/ops_torch.py` (2 threads, f32, eager, median of ROUNDS=7).
Forward, and forward+backward seeded with ones, as the Rust benchmark does. The
AdamW row is torch.optim.AdamW.step over 826,368 parameters (foreach default).
"""

import os
import statistics
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(2)
ROUNDS = int(os.environ.get("ROUNDS", "7"))


def med_ms(fn):
    fn()
    ts = []
    for _ in range(ROUNDS):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def op(name, x, f):
    x = x.requires_grad_(True)

    def fwd():
        with torch.no_grad():
            f(x)

    def fwd_bwd():
        y = f(x)
        y.backward(torch.ones_like(y))
        x.grad = None

    print(f"{name:<34} fwd {med_ms(fwd):8.2f} ms   fwd+bwd {med_ms(fwd_bwd):8.2f} ms")


def main():
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {ROUNDS}")
    op("gelu [16,128,512]", torch.randn(16, 128, 512), lambda x: F.gelu(x, approximate="tanh"))
    op("softmax [16,4,128,128]", torch.randn(16, 4, 128, 128), lambda x: torch.softmax(x, -1))
    w, b = torch.randn(128, requires_grad=True), torch.randn(128, requires_grad=True)
    op("layer norm [16,128,128]", torch.randn(16, 128, 128), lambda x: F.layer_norm(x, (128,), w, b, 1e-5))
    t = torch.tensor([i * 7 % 65 for i in range(2048)])
    op("cross-entropy [2048,65]", torch.randn(2048, 65), lambda x: F.cross_entropy(x, t, reduction="sum"))
    k, v = torch.randn(16, 4, 128, 32, requires_grad=True), torch.randn(16, 4, 128, 32, requires_grad=True)
    op(
        "causal attention [16,4,128,32]",
        torch.randn(16, 4, 128, 32),
        lambda q: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    )


    def attention_qkv(qkv):
        q, k, v = (z.view(16, 128, 4, 32).transpose(1, 2) for z in qkv.split(128, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(16, 128, 128)

    op("causal attention qkv [16,128,3x128]", torch.randn(16, 128, 384), attention_qkv)
    ids = torch.tensor([i * 31 % 65 for i in range(16 * 128)]).view(16, 128)
    op("embedding [65,128] x [16,128]", torch.randn(65, 128), lambda t: F.embedding(ids, t))
    p = torch.nn.Parameter(torch.randn(826_368))
    p.grad = torch.randn(826_368) * 1e-2
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1)
    print(f"adamw 826368 params                step {med_ms(opt.step):.2f} ms")


if __name__ == "__main__":
    main()
