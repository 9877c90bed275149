"""Training-step throughput: tc.compile_train_step vs PyTorch eager (CPU) vs NumPy.

The same step everywhere: an MLP (in -> hidden -> hidden -> 10, ReLU, Linear layers),
softmax cross-entropy (mean), AdamW. PyTorch is skipped when it is not installed. The
compiled step is also timed with BitLinear hidden layers (no reference for that one).

    python bench/train_step.py                      # digits-sized and MNIST-sized MLPs
    python bench/train_step.py --quick              # fewer steps
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

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01


class MLP(nn.Module):
    def __init__(self, d_in, hidden, layer=nn.Linear):
        self.fc1 = layer(d_in, hidden)
        self.fc2 = layer(hidden, hidden)
        self.head = nn.Linear(hidden, 10)

    def forward(self, x):
        return self.head(tc.relu(self.fc2(tc.relu(self.fc1(x)))))


def loss_fn(model, x, y):
    return tc.cross_entropy(model(x), y)


# -- NumPy reference: the same step by hand ----------------------------------------------
class NumpyStep:
    def __init__(self, params):
        self.p = {k: v.copy() for k, v in params.items()}
        self.m = {k: np.zeros_like(v) for k, v in self.p.items()}
        self.v = {k: np.zeros_like(v) for k, v in self.p.items()}
        self.t = 0

    def __call__(self, x, y):
        p = self.p
        h1p = x @ p["fc1.weight"].T + p["fc1.bias"]
        h1 = np.maximum(h1p, 0)
        h2p = h1 @ p["fc2.weight"].T + p["fc2.bias"]
        h2 = np.maximum(h2p, 0)
        z = h2 @ p["head.weight"].T + p["head.bias"]
        z = z - z.max(-1, keepdims=True)
        e = np.exp(z)
        s = e.sum(-1, keepdims=True)
        n = len(y)
        loss = float(np.mean(np.log(s[:, 0]) - z[np.arange(n), y]))
        dz = e / s
        dz[np.arange(n), y] -= 1
        dz /= n
        g = {"head.weight": dz.T @ h2, "head.bias": dz.sum(0)}
        d2 = (dz @ p["head.weight"]) * (h2p > 0)
        g["fc2.weight"], g["fc2.bias"] = d2.T @ h1, d2.sum(0)
        d1 = (d2 @ p["fc2.weight"]) * (h1p > 0)
        g["fc1.weight"], g["fc1.bias"] = d1.T @ x, d1.sum(0)
        self.t += 1
        b1, b2 = BETAS
        c1, c2 = 1 - b1 ** self.t, 1 - b2 ** self.t
        for k in p:
            p[k] *= 1 - LR * WD
            self.m[k] = b1 * self.m[k] + (1 - b1) * g[k]
            self.v[k] = b2 * self.v[k] + (1 - b2) * g[k] * g[k]
            p[k] -= LR * (self.m[k] / c1) / (np.sqrt(self.v[k] / c2) + EPS)
        return loss


def torch_step(params, d_in, hidden):
    try:
        import torch
    except ImportError:
        return None
    model = torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, 10))
    names = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "head.weight", "head.bias"]
    with torch.no_grad():
        for t, n in zip(model.parameters(), names):
            t.copy_(torch.from_numpy(params[n]))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    lossf = torch.nn.CrossEntropyLoss()

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = lossf(model(torch.from_numpy(x)), torch.from_numpy(y.astype(np.int64)))
        loss.backward()
        opt.step()
        return loss.item()
    return step


def rate(fn, x, y, steps, warmup=5):
    # IREE's local-task workers and OpenBLAS's threads both spin for a while after
    # work; on a small machine whichever ran last slows the other down. Let them park.
    time.sleep(1.0)
    for _ in range(warmup):
        fn(x, y)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn(x, y)
    return steps / (time.perf_counter() - t0)


def bench(batch, d_in, hidden, steps):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, d_in)).astype(np.float32)
    y = rng.integers(0, 10, batch).astype(np.int32)
    nn.manual_seed(0)
    model = MLP(d_in, hidden)
    # References first: in this process IREE's worker pool does not exist yet (the
    # first bench) or has been idle for a while.
    ref = NumpyStep(model.state_dict())
    rows = {"numpy": rate(ref, x, y, steps)}
    torch_fn = torch_step(model.state_dict(), d_in, hidden)
    if torch_fn is not None:
        rows["pytorch eager"] = rate(torch_fn, x, y, steps)
    opt = tc.optim.AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    t0 = time.perf_counter()
    step = tc.compile_train_step(loss_fn, model, opt, x, y)
    t_compile = time.perf_counter() - t0
    rows = {"tercomp (compiled)": rate(step, x, y, steps), **rows}
    # The same loss from both after the same number of steps: the steps are the same.
    l_tc, l_np = step(x, y), ref(x, y)
    assert abs(l_tc - l_np) < 1e-3 * max(1.0, abs(l_np)), (l_tc, l_np)
    if hasattr(nn, "BitLinear"):
        nn.manual_seed(0)
        bit = tc.compile_train_step(loss_fn, MLP(d_in, hidden, nn.BitLinear), opt, x, y)
        rows["tercomp BitLinear (compiled)"] = rate(bit, x, y, steps)
    print(f"\nMLP {d_in}-{hidden}-{hidden}-10, batch {batch}, AdamW "
          f"(compile {t_compile:.1f} s; {steps} timed steps)")
    base = rows["tercomp (compiled)"]
    for name, r in rows.items():
        print(f"  {name:30s} {r:9.1f} steps/s   tercomp / this = {base / r:6.2f}x")
    if torch_fn is None:
        print("  pytorch eager                  skipped (torch is not installed)")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    steps = 50 if args.quick else 300
    print(f"{os.cpu_count()} CPUs; llvm-cpu, local-task")
    bench(64, 64, 256, steps)                      # the digits sample's size
    bench(256, 784, 512, steps // 3)               # MNIST-sized


if __name__ == "__main__":
    main(sys.argv[1:])
