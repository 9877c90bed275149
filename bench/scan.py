"""tc.scan benchmark: compile time and IR size against the sequence length T (a scan
stays flat, the Python-unrolled loop grows), run time per step, and a selective-SSM
gradient step with tc.scan against tc.associative_scan (and PyTorch eager when torch
is installed).

    python bench/scan.py [--T 64 256 1024] [--max-unrolled 256] [--H 64] [--iters 5]
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
from tercomp.ir.graph import regions  # noqa: E402


def n_ops(graph):
    return sum(1 + sum(n_ops(b) for b in regions(op)) for op in graph.ops)


def rnn_loss(scanned):
    def loss(W, h0, xs):
        def step(h, x):
            h = tc.tanh(h @ W + x)
            return h, tc.sum(h * h)
        if scanned:
            h, ys = tc.scan(step, h0, xs)
            return tc.sum(ys) + tc.sum(h)
        h, total = h0, 0.0
        for t in range(xs.shape[0]):
            h, y = step(h, xs[t])
            total = total + y
        return total + tc.sum(h)
    return loss


def median_time(fn, iters):
    fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def compile_table(Ts, H, max_unrolled, iters):
    rng = np.random.default_rng(0)
    W = (rng.standard_normal((H, H)) * 0.3).astype(np.float32)
    h0 = np.zeros(H, np.float32)
    print(f"RNN gradient (h = tanh(h W + x), H={H}): traced ops, MLIR size, compile time, run time")
    print(f"{'T':>6} {'form':>9} {'ops':>7} {'MLIR KiB':>9} {'compile s':>10} {'run ms':>8} {'us/step':>8}")
    for T in Ts:
        xs = rng.standard_normal((T, H)).astype(np.float32)
        for scanned in (True, False):
            form = "scan" if scanned else "unrolled"
            if not scanned and T > max_unrolled:
                print(f"{T:>6} {form:>9}   (skipped: T > --max-unrolled {max_unrolled})")
                continue
            f = tc.grad(rnn_loss(scanned), argnums=(0, 1, 2))
            ops = n_ops(tc.trace(f, W, h0, xs))
            t0 = time.perf_counter()
            exe = tc.compile(f, W, h0, xs, cache=False)
            ct = time.perf_counter() - t0
            kib = len(exe.ir("mlir")) / 1024
            rt = median_time(lambda: exe(W, h0, xs), iters)
            print(f"{T:>6} {form:>9} {ops:>7} {kib:>9.1f} {ct:>10.2f} {rt * 1e3:>8.2f} {rt / T * 1e6:>8.1f}")


def ssm_table(T, iters, batch=4, d_model=32):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((batch, T, d_model)).astype(np.float32)
    print(f"\nMambaBlock gradient step (B={batch}, T={T}, d_model={d_model}, d_inner={2 * d_model}, N=16)")
    times = {}
    for mode in ("scan", "associative"):
        nn.manual_seed(0)
        blk = nn.MambaBlock(d_model, mode=mode)
        f = tc.grad(lambda m, x: tc.mean(m(x) ** 2))
        t0 = time.perf_counter()
        exe = tc.compile(f, blk, x, cache=False)
        ct = time.perf_counter() - t0
        times[mode] = median_time(lambda: exe(blk, x), iters)
        print(f"  {mode:>11}: compile {ct:6.2f} s, step {times[mode] * 1e3:8.2f} ms")
    try:
        import torch
    except ImportError:
        print("  torch not installed: no PyTorch eager comparison")
        return
    nn.manual_seed(0)
    blk = nn.MambaBlock(d_model)
    step = torch_mamba_step(torch, blk, x)
    t_torch = median_time(step, iters)
    best = min(times.values())
    print(f"  torch eager: step {t_torch * 1e3:8.2f} ms; ratio torch / tercomp {t_torch / best:.2f} "
          "(goal >= 1)")


def torch_mamba_step(torch, blk, x):
    """The same block in PyTorch eager (straight-through ternary projections, a Python
    loop over time), forward + backward."""
    p = {k: torch.tensor(v, requires_grad=True) for k, v in blk.parameters().items()}
    tx = torch.tensor(x)

    def bitlinear(z, w):
        s = w.abs().mean().clamp_min(1e-5)
        wq = w + ((w / s).round().clamp(-1, 1) * s - w).detach()
        a = 127.0 / z.abs().amax(-1, keepdim=True).clamp_min(1e-5)
        zq = z + ((z * a).round().clamp(-127, 127) / a - z).detach()
        return zq @ wq.T

    def step():
        for t in p.values():
            t.grad = None
        d_in, r, n = blk.d_inner, blk.ssm.dt_rank, blk.ssm.d_state
        h = tx * torch.rsqrt((tx * tx).mean(-1, keepdim=True) + 1e-6) * p["norm.weight"]
        u = bitlinear(h, p["in_proj.weight"])
        xi, z = torch.nn.functional.silu(u[..., :d_in]), u[..., d_in:]
        proj = xi @ p["ssm.x_proj.weight"].T
        delta = torch.nn.functional.softplus(proj[..., :r] @ p["ssm.dt_proj.weight"].T + p["ssm.dt_proj.bias"])
        Bm, Cm, A = proj[..., r:r + n], proj[..., r + n:], -torch.exp(p["ssm.A_log"])
        state, ys = torch.zeros(x.shape[0], d_in, n), []
        for t in range(x.shape[1]):
            dt = delta[:, t, :, None]
            state = torch.exp(dt * A) * state + dt * Bm[:, t, None, :] * xi[:, t, :, None]
            ys.append((state * Cm[:, t, None, :]).sum(-1) + p["ssm.D"] * xi[:, t])
        y = torch.stack(ys, 1) * torch.nn.functional.silu(z)
        out = tx + bitlinear(y, p["out_proj.weight"])
        (out ** 2).mean().backward()
    return step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--max-unrolled", type=int, default=256)
    ap.add_argument("--H", type=int, default=64)
    ap.add_argument("--ssm-T", type=int, default=64)
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args()
    compile_table(a.T, a.H, a.max_unrolled, a.iters)
    ssm_table(a.ssm_T, a.iters)


if __name__ == "__main__":
    main()
