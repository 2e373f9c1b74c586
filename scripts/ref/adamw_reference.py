#!/usr/bin/env python3
"""Reference vectors for stoker-train's optimizers, computed by torch on CPU.

Writes crates/stoker-train/tests/data/optim_reference.json: initial parameters, the
gradients fed at each step, the learning rates, and torch's parameters after every step
for torch.optim.AdamW (two param groups: with and without weight decay) and
torch.optim.SGD (momentum 0.9, weight decay, plain and Nesterov).

    python3 scripts/ref/adamw_reference.py
"""
import json
import pathlib

import torch

OUT = pathlib.Path(__file__).resolve().parents[2] / "crates/stoker-train/tests/data/optim_reference.json"
STEPS = 6
LRS = [1e-3, 3e-3, 1e-2, 5e-3, 2e-3, 1e-4]


def tensors(gen):
    # Mixed magnitudes, so eps and bias correction both matter.
    w = torch.randn(7, 5, generator=gen) * 0.5
    b = torch.randn(5, generator=gen) * 1e-3
    return [w, b]


def grads(gen, step):
    scale = [1.0, 1e-4, 10.0, 0.1, 1.0, 3.0][step]
    return [torch.randn(7, 5, generator=gen) * scale, torch.randn(5, generator=gen) * scale]


def run(make_opt):
    gen = torch.Generator().manual_seed(1234)
    params = [p.clone().requires_grad_(True) for p in tensors(gen)]
    init = [p.detach().flatten().tolist() for p in params]
    opt = make_opt(params)
    steps = []
    for s in range(STEPS):
        gs = grads(gen, s)
        for p, g in zip(params, gs):
            p.grad = g.clone()
        for group in opt.param_groups:
            group["lr"] = LRS[s]
        opt.step()
        steps.append({
            "lr": LRS[s],
            "grads": [g.flatten().tolist() for g in gs],
            "params": [p.detach().flatten().tolist() for p in params],
        })
    return {"init": init, "shapes": [list(p.shape) for p in params], "steps": steps}


def main():
    torch.set_num_threads(1)
    out = {
        "torch": torch.__version__,
        "adamw": run(lambda ps: torch.optim.AdamW(
            [{"params": [ps[0]], "weight_decay": 0.1}, {"params": [ps[1]], "weight_decay": 0.0}],
            lr=LRS[0], betas=(0.9, 0.95), eps=1e-8, foreach=False)),
        "adamw_config": {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1},
        "sgd": run(lambda ps: torch.optim.SGD(
            [{"params": [ps[0]], "weight_decay": 0.01}, {"params": [ps[1]], "weight_decay": 0.0}],
            lr=LRS[0], momentum=0.9, foreach=False)),
        "sgd_nesterov": run(lambda ps: torch.optim.SGD(
            [{"params": [ps[0]], "weight_decay": 0.01}, {"params": [ps[1]], "weight_decay": 0.0}],
            lr=LRS[0], momentum=0.9, nesterov=True, foreach=False)),
        "sgd_config": {"momentum": 0.9, "weight_decay": 0.01},
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out))
    print(f"wrote {OUT} (torch {torch.__version__})")


if __name__ == "__main__":
    main()
