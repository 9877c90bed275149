"""tercomp's compiled BitLinear against IREE's f32 matmul and NumPy, through the public API.

    python bench/ternary_matmul.py            # one layer per shape, weights cache-resident
    python bench/ternary_matmul.py --cold     # distinct 4096x4096 layers chained (decode
                                              # with weights streaming from memory)
    python bench/ternary_matmul.py --memory   # resident memory of a fresh process that
                                              # loads the saved artifact and calls it
    python bench/ternary_matmul.py --overhead # tercomp's per-call cost over IREE's invoke

Each row is `tc.compile(model, tc.spec(("B", K)), ternary=strategy)` of an nn.BitLinear
stack (one module for every batch size), timed as a user calls it (`exe(x)`: NumPy in,
NumPy out); "IREE f32" is the same stack as nn.Linear
on the dense ternary weights (scale * T) with data tiling; "numpy f32" is `x @ W.T`. All
take turns (bench/ternary_kernels.py's interleaving) and print the median, the min and
their ratios to NumPy measured in the same run. For a square layer a warm run also times
the auto module's kernel without the call's overhead: the one layer applied 16 times in
one call, per layer. bench/ternary_kernels.py times the bare kernels without tercomp.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import tercomp as tc  # noqa: E402
from tercomp import nn  # noqa: E402
from tercomp.kernels.table import host_cpu_features  # noqa: E402
from tercomp.kernels.ternary.strategies import STRATEGIES as ROWS, choose_strategy  # noqa: E402
from tercomp.ternary_pack import absmean_ternarize  # noqa: E402
from ternary_kernels import DENSE_FLAGS, SHAPES, interleaved_medians, print_rows  # noqa: E402

# the hand-scheduled kernels by name too (where the host has their feature), so that auto's
# choice is timed against the others in the same run
STRATEGIES = ["auto", *(s for s in ("avx512", "avx2") if ROWS[s].feature in host_cpu_features()),
              "addsub", "blocked", "int8"]


class Stack(nn.Module):
    """`count` layers of `layer(k, n)` applied in turn (N == K when count > 1)."""

    def __init__(self, layers):
        self.layers = layers

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Repeat(nn.Module):
    """One layer applied `times` times in one call: its weights stay in cache and the
    call's overhead is shared by every application (the kernel's own time per layer)."""

    def __init__(self, layer, times):
        self.layer, self.times = layer, times

    def forward(self, x):
        for _ in range(self.times):
            x = self.layer(x)
        return x


#: applications of the one layer in the "kernel" row of a warm run
REPEAT = 16


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


def run(m, k, n, count, rounds, rng, weights, only=()):
    bit, dense, ws = models(count, k, n, rng)
    x = rng.standard_normal((m, k)).astype(np.float32)

    def numpy_chain():
        y = x
        for w in ws:
            y = y @ w.T
        return y

    fns = {"numpy f32 x @ W.T": numpy_chain}
    per_call = {}                   # label -> layers a call runs, where not `count`
    t0 = time.perf_counter()
    f32 = tc.compile(dense, x, ternary="off", flags=DENSE_FLAGS, weights=weights, cache=False)
    fns[f"IREE f32 matmul (nn.Linear)  [compile {time.perf_counter() - t0:.1f}s]"] = lambda: f32(x)
    # one module per strategy for every batch size, as a user compiles it (the README's
    # way): the batch is symbolic and "auto" dispatches on it at run time
    spec = tc.spec(("B", k), "float32")
    for s in STRATEGIES:
        if only and s not in only:
            continue
        t0 = time.perf_counter()
        exe = tc.compile(bit, spec, ternary=s, weights=weights, cache=False)
        label = f"BitLinear ternary={s}  [compile {time.perf_counter() - t0:.1f}s]"
        fns[label] = lambda exe=exe: exe(x)
        if s == "auto":
            # the same module through IREE's own invoke: tercomp's per-call overhead
            fn, xd = exe._load(), np.ascontiguousarray(x)
            fns["  the auto module, bare IREE invoke + to_host"] = lambda: fn(xd).to_host()
            if count == 1 and k == n:
                rep = tc.compile(Repeat(bit.layers[0], REPEAT), spec, ternary=s,
                                 weights=weights, cache=False)
                label = f"  the auto kernel alone: {REPEAT} layers a call, per layer"
                fns[label] = lambda: rep(x)
                per_call[label] = REPEAT
    return [(name, med / per_call.get(name, count), best / per_call.get(name, count))
            for name, (med, best) in interleaved_medians(fns, rounds).items()]


def overhead(rounds: int, calls: int = 200) -> None:
    """Microseconds a call of a compiled module adds over IREE's own invoke (+ to_host),
    on a module small enough that the kernel is negligible: exe(x) against the same
    loaded function called bare, in turns."""
    nn.manual_seed(0)
    exe = tc.compile(nn.BitLinear(128, 128), tc.spec(("B", 128), "float32"), cache=False)
    x = np.random.default_rng(0).standard_normal((1, 128)).astype(np.float32)
    fn, xd = exe._load(), np.ascontiguousarray(x)
    fns = {"exe(x)": lambda: exe(x), "bare IREE invoke + to_host": lambda: fn(xd).to_host()}
    per = {name: [] for name in fns}
    for f in fns.values():
        f()
    for _ in range(rounds):
        for name, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                f()
            per[name].append((time.perf_counter() - t0) / calls)
    (a, b) = (np.array(per[n]) * 1e6 for n in fns)
    print(f"\nper-call time, BitLinear(128, 128), B=1, {rounds} rounds of {calls} calls each")
    for name, t in zip(fns, (a, b)):
        print(f"  {name:28s} median {np.median(t):7.1f} us   min {np.min(t):7.1f} us")
    print(f"  tercomp's overhead           median {np.median(a - b):7.1f} us   "
          f"min {np.min(a) - np.min(b):7.1f} us")


# Run in a fresh process: RSS (VmRSS, MiB) before and after tc.load and after each call.
_MEASURE = r"""
import sys, numpy as np
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
import tercomp as tc
base = rss()
exe = tc.load(sys.argv[1])
exe(np.zeros((1, int(sys.argv[2])), np.float32))    # the first call loads the module
print(f"  after load + B=1 call      +{rss() - base:7.1f} MiB")
exe(np.zeros((128, int(sys.argv[2])), np.float32))
print(f"  after a B=128 call         +{rss() - base:7.1f} MiB")
exe(np.zeros((1, int(sys.argv[2])), np.float32))
print(f"  after another B=1 call     +{rss() - base:7.1f} MiB")
"""


def memory(count, k, strategies, rng):
    """Resident memory growth of a fresh process loading a saved symbolic-batch artifact
    of `count` distinct k x k BitLinear layers (weights as .irpa parameters)."""
    bit, _, _ = models(count, k, k, rng)
    packed_mib = count * k * k / 4 / 2**20
    for s in strategies:
        exe = tc.compile(bit, tc.spec(("B", k), "float32"), ternary=s, weights="irpa", cache=False)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "m.tcm")
            exe.save(path)
            print(f"\nternary={s}: {count} x {k}x{k} layers, {packed_mib:.0f} MiB packed, "
                  f"artifact {os.path.getsize(path) / 2**20:.0f} MiB")
            sys.stdout.flush()
            subprocess.run([sys.executable, "-c", _MEASURE, path, str(k)], check=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cold", action="store_true", help="distinct 4096x4096 layers chained, M=1")
    ap.add_argument("--layers", type=int, default=8, help="layer count for --cold")
    ap.add_argument("--rounds", type=int, default=20, help="turns each variant gets")
    ap.add_argument("--memory", action="store_true",
                    help="RSS growth of a fresh process loading a saved 16-layer artifact")
    ap.add_argument("--overhead", action="store_true",
                    help="tercomp's per-call cost over IREE's invoke, on a tiny module")
    ap.add_argument("--shapes", default="",
                    help="comma-separated MxKxN shapes (default: "
                         + ",".join("x".join(map(str, s)) for s in SHAPES) + ")")
    ap.add_argument("--only", default="",
                    help="comma-separated strategies to time (default: " + ",".join(STRATEGIES) + ")")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    if args.overhead:
        overhead(args.rounds)
        return
    if args.memory:
        memory(16, 4096, ["auto", "int8"], rng)
        return
    shapes = ([tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
              if args.shapes else SHAPES)
    shapes = [(1, 4096, 4096)] if args.cold else shapes
    count = args.layers if args.cold else 1
    # cold: weights as .irpa parameters (as a large model would ship), so the compiler
    # never prints gigabytes of constants
    weights = "irpa" if args.cold else "inline"
    for m, k, n in shapes:
        print(f"\n{m}x{k}x{n}" + (f"  cold: {count} distinct layers, time per layer" if args.cold else "")
              + f"   (auto -> {choose_strategy(None, k, n)}, which runs {choose_strategy(m, k, n)} here)")
        print_rows(run(m, k, n, count, args.rounds, rng, weights,
                       set(filter(None, args.only.split(",")))))

if __name__ == "__main__":
    main()
