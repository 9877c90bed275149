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


class Block(nn.Module):
    def __init__(self, d, heads, hidden):
        self.d, self.heads = d, heads
        self.norm1 = nn.RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.norm2 = nn.RMSNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def attention(self, x, mask):
        T, d, H = x.shape[0], self.d, self.heads
        hd = d // H
        q, k, v = tc.split(self.qkv(x), 3, axis=-1) if hasattr(tc, "split") else _split3(self.qkv(x), d)
        q, k, v = (tc.transpose(tc.reshape(t, T, H, hd), (1, 0, 2)) for t in (q, k, v))
        s = tc.matmul(q, k, transpose_b=True) * (1.0 / np.sqrt(hd))
        s = tc.where(mask, s, np.full(mask.shape, -1e9, np.float32))
        o = tc.matmul(tc.softmax(s, axis=-1), v)
        return self.proj(tc.reshape(tc.transpose(o, (1, 0, 2)), T, d))

    def forward(self, x, mask):
        x = x + self.attention(self.norm1(x), mask)
        return x + self.fc2(tc.gelu(self.fc1(self.norm2(x))))


def _split3(t, d):
    return t[:, :d], t[:, d:2 * d], t[:, 2 * d:]


def loss(model, x, mask, target):
    y = model(x, mask)
    return tc.mean((y - target) * (y - target))


def median_time(fn, iters):
    fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def torch_step(model, x, mask, target, heads):
    import torch
    p = {k: torch.tensor(v, requires_grad=True) for k, v in model.parameters().items()}
    tx, tm, tt = torch.tensor(x), torch.tensor(mask), torch.tensor(target)
    T, d = x.shape
    hd = d // heads

    def rms(z, w):
        return z * torch.rsqrt((z * z).mean(-1, keepdim=True) + 1e-6) * w

    def step():
        for t in p.values():
            t.grad = None
        h = rms(tx, p["norm1.weight"])
        q, k, v = (h @ p["qkv.weight"].T).split(d, -1)
        q, k, v = (t.reshape(T, heads, hd).transpose(0, 1) for t in (q, k, v))
        s = (q @ k.transpose(-1, -2)) / np.sqrt(hd)
        s = s.masked_fill(~tm, -1e9)
        o = (torch.softmax(s, -1) @ v).transpose(0, 1).reshape(T, d)
        y = tx + o @ p["proj.weight"].T
        z = rms(y, p["norm2.weight"]) @ p["fc1.weight"].T + p["fc1.bias"]
        y = y + torch.nn.functional.gelu(z, approximate="tanh") @ p["fc2.weight"].T + p["fc2.bias"]
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
    model = Block(a.D, a.heads, 4 * a.D)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((a.T, a.D)).astype(np.float32)
    target = rng.standard_normal((a.T, a.D)).astype(np.float32)
    mask = np.tril(np.ones((a.T, a.T), bool))

    fwd = run_pipeline(tc.trace(loss, model, x, mask, target), ["simplify"])
    joint = run_pipeline(tc.trace(tc.grad(loss), model, x, mask, target), ["simplify"])
    print(f"transformer block T={a.T} D={a.D} heads={a.heads}")
    print(f"forward ops: {len(fwd.ops)}")
    print(f"joint ops (forward + backward, simplified): {len(joint.ops)}")

    t0 = time.perf_counter()
    exe = tc.compile(tc.grad(loss), model, x, mask, target)
    print(f"compile: {time.perf_counter() - t0:.2f} s")
    t_tc = median_time(lambda: exe(model, x, mask, target), a.iters)
    print(f"tercomp grad step: {t_tc * 1e3:.3f} ms (median of {a.iters})")
    try:
        import torch  # noqa: F401
    except ImportError:
        print("torch not installed: no comparison")
        return
    step = torch_step(model, x, mask, target, a.heads)
    g_tc, g_t = exe(model, x, mask, target), step()
    err = max(float(np.max(np.abs(g_tc[k] - g_t[k].numpy()))) for k in g_t)
    t_torch = median_time(step, a.iters)
    print(f"torch eager CPU grad step: {t_torch * 1e3:.3f} ms (max grad difference {err:.2e})")
    print(f"ratio tercomp / torch: {t_tc / t_torch:.2f}")


if __name__ == "__main__":
    main()
