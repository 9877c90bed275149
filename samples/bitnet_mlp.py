"""The README's main job: a ternary (BitNet b1.58) MLP traced with a symbolic batch,
compiled once into 2-bit packed kernels, checked against NumPy and timed against it.

    python samples/bitnet_mlp.py                 # 784 -> 4096 -> 4096 -> 10
    python samples/bitnet_mlp.py --hidden 1024   # smaller and quicker

It prints the ternary stage of the IR (each BitLinear became one `tern.ternary_matmul`
on a packed i8 constant) with, under each layer, why the kernel table
(tercomp/kernels/table.py) gave it its kernel, the packed size against f32, the largest difference from the
NumPy reference of the same arithmetic (int8 activations, ternary weights), and the
time of one call against NumPy's f32 matmuls on the same weights (medians of the same
run; machines are noisy, so read the ratio, not the milliseconds).
"""
from __future__ import annotations

import argparse
import re
import time

import numpy as np

import tercomp as tc
from tercomp import nn
from tercomp import ternary_pack as tp
from tercomp.kernels import table


class BitMLP(nn.Module):
    def __init__(self, d_in=784, d_hidden=4096, d_out=10):
        self.fc1 = nn.BitLinear(d_in, d_hidden)
        self.fc2 = nn.BitLinear(d_hidden, d_hidden)
        self.fc3 = nn.BitLinear(d_hidden, d_out)

    def forward(self, x):
        return self.fc3(tc.relu(self.fc2(tc.relu(self.fc1(x)))))


def layers(model):
    return [model.fc1, model.fc2, model.fc3]


def reference(model, x):
    """The compiled arithmetic in NumPy: per-row int8 activations times the ternary
    weights, times the layer's scale (tercomp.ternary_pack)."""
    for i, layer in enumerate(layers(model)):
        t, scale = layer.ternary()
        x = tp.ternary_matmul_reference(x, tp.pack_ternary(t), layer.in_features, scale, True)
        x = np.maximum(x, 0) if i < 2 else x
    return x.astype(np.float32)


def numpy_dense(weights, x):
    """The same network as plain f32 NumPy matmuls: the baseline for speed."""
    for i, w in enumerate(weights):
        x = x @ w.T
        x = np.maximum(x, 0) if i < 2 else x
    return x


def median_ms(fn, repeat):
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * float(np.median(times))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=20)
    a = p.parse_args(argv)
    nn.manual_seed(0)
    model = BitMLP(d_hidden=a.hidden)
    exe = tc.compile(model, tc.spec(("B", 784), "float32"))   # ternary="auto"
    kernels = [line.strip() for line in exe.ir("ternary").splitlines()
               if "tern.ternary_matmul" in line]
    print("ternary stage (one kernel per BitLinear), and why each layer got its kernel:")
    for line in kernels:
        strategy = re.search(r'strategy = "([\w-]+)"', line).group(1)
        print("   ", line)
        print("      why:", table.row("ternary_matmul", strategy).describe())
    n_weights = sum(layer.in_features * layer.out_features for layer in layers(model))
    packed = sum(tp.pack_ternary(layer.ternary()[0]).nbytes for layer in layers(model))
    print(f"weights: {n_weights / 1e6:.1f} M, packed {packed / 2**20:.1f} MiB "
          f"vs f32 {4 * n_weights / 2**20:.1f} MiB ({4 * n_weights / packed:.1f}x smaller)")
    rng = np.random.default_rng(0)
    dense = [(lambda t, s: (t * s).astype(np.float32))(*layer.ternary()) for layer in layers(model)]
    for batch in (1, 7, 64):
        x = rng.standard_normal((batch, 784)).astype(np.float32)
        y = exe(x)
        ref = reference(model, x)
        err = np.abs(y - ref).max() / np.abs(ref).max()
        ours = median_ms(lambda: exe(x), a.repeat)
        theirs = median_ms(lambda: numpy_dense(dense, x), a.repeat)
        print(f"batch {batch:3d}: output {y.shape}, max |tercomp - numpy| / max|y| = {err:.1e}; "
              f"{ours:.2f} ms vs NumPy f32 {theirs:.2f} ms (speed {theirs / ours:.2f}x NumPy)")
        # Each kernel equals the reference up to f32 rounding of its scaling; through three
        # layers that rounding can move an activation across an int8 rounding boundary
        # (a change of one step in 127), so the network agrees to about 1e-2.
        assert err < 1e-2, err
    print("bitnet_mlp: OK")
    return exe


if __name__ == "__main__":
    main()
