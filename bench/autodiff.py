"""Autodiff benchmark: a transformer block (causal self-attention with RMSNorm, and an
MLP), its forward and joint (forward + backward, after simplify) op counts, and the
compiled gradient step's median time against PyTorch eager on CPU in the same run.

    python bench/autodiff.py [--T 64] [--D 128] [--heads 4] [--iters 30]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tercomp as tc  # noqa: E402
from tercomp import nn  # noqa: E402
from tercomp.passes import run_pipeline  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "samples"))
from transformer_block import Block  # noqa: E402  (the sample's block: one definition)


def loss(model, x, target):
    y = model(x)
    return tc.mean((y - target) * (y - target))


def median_time(fn, iters):
    fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def torch_step(model, x, target):
    """The same block and loss in PyTorch eager, on the same parameters."""
    import torch
    p = {k: torch.tensor(v, requires_grad=True) for k, v in model.parameters().items()}
    tx, tt = torch.tensor(x), torch.tensor(target)
    B, T, C = x.shape
    H, D = model.heads, C // model.heads
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))

    def rms(z, w):
        return z * torch.rsqrt((z * z).mean(-1, keepdim=True) + 1e-6) * w

    def step():
        for t in p.values():
            t.grad = None
        qkv = (rms(tx, p["norm1.weight"]) @ p["qkv.weight"].T).reshape(B, T, 3, H, D)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        s = (q @ k.transpose(-1, -2)) / np.sqrt(D)
        s = s.masked_fill(~causal, -1e9)
        o = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(B, T, C)
        y = tx + o @ p["proj.weight"].T
        z = rms(y, p["norm2.weight"]) @ p["up.weight"].T + p["up.bias"]
        y = y + torch.nn.functional.gelu(z, approximate="tanh") @ p["down.weight"].T + p["down.bias"]
        ((y - tt) ** 2).mean().backward()
        return {k: t.grad for k, t in p.items()}
    return step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=64)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--iters", type=int, default=30)
    a = ap.parse_args()
    nn.manual_seed(0)
    model = Block(dim=a.D, heads=a.heads, seq=a.T, hidden=4 * a.D)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, a.T, a.D)).astype(np.float32)
    target = rng.standard_normal((1, a.T, a.D)).astype(np.float32)

    fwd = run_pipeline(tc.trace(loss, model, x, target), ["simplify"])
    joint = run_pipeline(tc.trace(tc.grad(loss), model, x, target), ["simplify"])
    print(f"transformer block T={a.T} D={a.D} heads={a.heads}")
    print(f"forward ops: {len(fwd.ops)}")
    print(f"joint ops (forward + backward, simplified): {len(joint.ops)}")

    t0 = time.perf_counter()
    exe = tc.compile(tc.grad(loss), model, x, target)
    print(f"compile: {time.perf_counter() - t0:.2f} s")
    t_tc = median_time(lambda: exe(model, x, target), a.iters)
    print(f"tercomp grad step: {t_tc * 1e3:.3f} ms (median of {a.iters})")
    try:
        import torch  # noqa: F401
    except ImportError:
        print("torch not installed: no comparison")
        return
    step = torch_step(model, x, target)
    g_tc, g_t = exe(model, x, target), step()
    err = max(float(np.max(np.abs(g_tc[k] - g_t[k].numpy()))) for k in g_t)
    t_torch = median_time(step, a.iters)
    print(f"torch eager CPU grad step: {t_torch * 1e3:.3f} ms (max grad difference {err:.2e})")
    print(f"ratio tercomp / torch: {t_tc / t_torch:.2f}")


if __name__ == "__main__":
    main()
