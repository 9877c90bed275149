"""tercomp's compiled BitLinear against IREE's f32 matmul and NumPy, through the public API.

    python bench/ternary_matmul.py            # one layer per shape, weights cache-resident
    python bench/ternary_matmul.py --cold     # distinct 4096x4096 layers chained (decode
                                              # with weights streaming from memory)

Each row is `tc.compile(model, x, ternary=strategy)` of an nn.BitLinear stack, timed as a
user calls it (`exe(x)`: NumPy in, NumPy out); "IREE f32" is the same stack as nn.Linear
on the dense ternary weights (scale * T) with data tiling; "numpy f32" is `x @ W.T`. All
take turns (bench/ternary_kernels.py's interleaving) and print the median, the min and
their ratios to NumPy measured in the same run. bench/ternary_kernels.py times the bare
kernels without tercomp's call overhead.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import tercomp as tc  # noqa: E402
from tercomp import nn  # noqa: E402
from tercomp.codegen.ternary_strategies import choose_strategy  # noqa: E402
from tercomp.ops.ternary_pack import absmean_ternarize  # noqa: E402
from ternary_kernels import DENSE_FLAGS, SHAPES, interleaved_medians, print_rows  # noqa: E402

STRATEGIES = ["auto", "addsub", "int8", "f32"]


class Stack(nn.Module):
    """`count` layers of `layer(k, n)` applied in turn (N == K when count > 1)."""

    def __init__(self, layers):
        self.layers = layers

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def models(count, k, n, rng):
    bit, dense = [], []
    for _ in range(count):
        w = rng.standard_normal((n, k)).astype(np.float32)
        b = nn.BitLinear(k, n)
        b.weight = w
        t, scale = absmean_ternarize(w)
        d = nn.Linear(k, n, bias=False)
        d.weight = (t * scale).astype(np.float32)
        bit.append(b)
        dense.append(d)
    return Stack(bit), Stack(dense), [d.weight for d in dense]


def run(m, k, n, count, rounds, rng, weights):
    bit, dense, ws = models(count, k, n, rng)
    x = rng.standard_normal((m, k)).astype(np.float32)

    def numpy_chain():
        y = x
        for w in ws:
            y = y @ w.T
        return y

    fns = {"numpy f32 x @ W.T": numpy_chain}
    t0 = time.perf_counter()
    f32 = tc.compile(dense, x, ternary="off", flags=DENSE_FLAGS, weights=weights, cache=False)
    fns[f"IREE f32 matmul (nn.Linear)  [compile {time.perf_counter() - t0:.1f}s]"] = lambda: f32(x)
    for s in STRATEGIES:
        t0 = time.perf_counter()
        exe = tc.compile(bit, x, ternary=s, weights=weights, cache=False)
        label = f"BitLinear ternary={s}  [compile {time.perf_counter() - t0:.1f}s]"
        fns[label] = lambda exe=exe: exe(x)
    return [(name, med / count, best / count)
            for name, (med, best) in interleaved_medians(fns, rounds).items()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cold", action="store_true", help="distinct 4096x4096 layers chained, M=1")
    ap.add_argument("--layers", type=int, default=8, help="layer count for --cold")
    ap.add_argument("--rounds", type=int, default=20, help="turns each variant gets")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    shapes = [(1, 4096, 4096)] if args.cold else SHAPES
    count = args.layers if args.cold else 1
    # cold: weights as .irpa parameters (as a large model would ship), so the compiler
    # never prints gigabytes of constants
    weights = "irpa" if args.cold else "inline"
    for m, k, n in shapes:
        print(f"\n{m}x{k}x{n}" + (f"  cold: {count} distinct layers, time per layer" if args.cold else "")
              + f"   (auto -> {choose_strategy(m, k, n)})")
        print_rows(run(m, k, n, count, args.rounds, rng, weights))

if __name__ == "__main__":
    main()
