"""Time the ternary matmul kernels against NumPy f32 and IREE's own f32 matmul.

    python bench/ternary_kernels.py            # warm: one layer, weights cache-resident
    python bench/ternary_kernels.py --cold     # 16 distinct 4096x4096 layers chained,
                                               # so weights stream from DRAM (decode)

Every number is the median wall time of `main(x)` including `.to_host()` of the result,
with x already on the device (`iree.runtime.asdevicearray`), and its ratio to NumPy's
`x @ W.T` measured in the same run; all kernels take turns, so load from other
processes affects them alike. The min (and its ratio to NumPy's min) is printed too: on
a shared machine it is the better estimate of the unloaded time. The ternary kernels quantize activations
(act_quant=True, BitNet b1.58) unless the row says "noquant".

A caveat found on the 2-core VM: of identical modules loaded in one process, the one
loaded first measured slowest in two runs of three (the same 128x4096x4096 kernel
three times: 0.43x, 0.39x and 0.34x NumPy's median in load order, with the turns
rotated; the third run 0.43x each). Compare variants in both load orders.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import iree.runtime as rt  # noqa: E402
from iree.compiler import ir  # noqa: E402
from iree.compiler.dialects import arith, func, linalg, tensor  # noqa: E402

from tercomp.codegen.iree_session import HOST_CPU_FLAGS, compile_module, new_session  # noqa: E402
from tercomp.kernels.table import host_cpu_features, ternary_types  # noqa: E402
from tercomp.kernels.ternary.strategies import (STRATEGIES, choose_strategy,  # noqa: E402
                                                emit_ternary_matmul, strategy_flags)
from tercomp.ternary_pack import absmean_ternarize, pack_ternary, to_offset_codes  # noqa: E402

SHAPES = [(1, 4096, 4096), (8, 4096, 4096), (128, 4096, 4096)]
# (strategy, act_quant, 2-bit codes): avx512 and avx2 on the offset codes the ternary pass
# stores for them, and on the signed codes (remapped in registers, as for a weight passed
# at run time)
VARIANTS = [("amx", True, "offset"), ("avx512-tall", True, "offset"), ("avx512", True, "offset"), ("avx512", True, "signed"),
            ("avx2", True, "offset"), ("avx2", True, "signed"), ("addsub", True, "signed"),
            ("vnni", True, "signed"), ("int8", True, "signed"), ("f32", True, "signed"),
            ("f32", False, "signed")]
DENSE_FLAGS = ["--iree-opt-data-tiling=true", "--iree-llvmcpu-enable-ukernels=all",
               "--iree-opt-const-expr-max-size-increase-threshold=4294967296",
               "--iree-opt-const-eval=false"]


class Loaded:
    """A compiled module on local-task with device-resident inputs."""

    def __init__(self, vmfb: bytes):
        self.config = rt.Config("local-task")
        self.ctx = rt.SystemContext(config=self.config)
        self.ctx.add_vm_module(rt.VmModule.copy_buffer(self.ctx.instance, vmfb))
        self.main = self.ctx.modules.module["main"]

    def on_device(self, x: np.ndarray):
        return rt.asdevicearray(self.config.device, x)


def interleaved_medians(fns: dict, rounds: int, calls: int = 5) -> dict:
    """(median, min) seconds per call of each fn. The fns take turns (`calls` each, `rounds`
    times, each round starting with the next fn) so that a load change on the machine
    hits all of them alike and the ratios stay meaningful; the first calls (hoisted
    initializers, page faults) are dropped."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
        fn()
    order = list(fns.items())
    for r in range(rounds):
        # each round starts one further along, so that no fn always runs right after the
        # same one (NumPy's sweep of 64 MiB evicts the caches of whatever runs next)
        for name, fn in order[r % len(order):] + order[:r % len(order)]:
            for _ in range(calls):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return {name: (float(np.median(t)), float(np.min(t))) for name, t in times.items()}


def make_layers(count: int, k: int, n: int, rng):
    layers = []
    for _ in range(count):
        t, scale = absmean_ternarize(rng.standard_normal((n, k)).astype(np.float32))
        layers.append((t, scale, pack_ternary(t)))
    return layers


def compile_chain(m: int, k: int, layers, emit_one, flags) -> Loaded:
    """A `main` applying every layer in turn (N == K when there are several)."""
    # Not build_and_compile: it prints the module, which means gigabytes of hex here.
    session, ctx = new_session()
    with ctx, ir.Location.unknown():
        module = ir.Module.create()
        with ir.InsertionPoint(module.body):
            @func.FuncOp.from_py_func(ir.RankedTensorType.get([m, k], ir.F32Type.get()))
            def main(x):
                for layer in layers:
                    x = emit_one(x, layer)
                return x
        vmfb = compile_module(session, module, [*HOST_CPU_FLAGS, *flags])
    return Loaded(vmfb)


def emit_dense(x, layer):
    """IREE's own f32 matmul on the dense weights scale * T (the baseline to beat)."""
    t, scale, _ = layer
    w = np.ascontiguousarray((t * scale).astype(np.float32))
    f32 = ir.F32Type.get()
    m = ir.RankedTensorType(x.type).get_dim_size(0)
    wc = arith.constant(ir.RankedTensorType.get(list(w.shape), f32), ir.DenseElementsAttr.get(w))
    out = linalg.fill(arith.constant(f32, 0.0), outs=[tensor.empty([m, w.shape[0]], f32)])
    maps = [ir.AffineMap.get(3, 0, [ir.AffineDimExpr.get(a), ir.AffineDimExpr.get(b)])
            for a, b in ((0, 2), (1, 2), (0, 1))]
    return linalg.matmul(x, wc, outs=[out], indexing_maps=maps)


def run(m: int, k: int, n: int, n_layers: int, rounds: int, rng, only=None,
        only_codes=None) -> list:
    """(label, median, min seconds per layer) for NumPy, IREE f32 and each variant."""
    layers = make_layers(n_layers, k, n, rng)
    x = rng.standard_normal((m, k)).astype(np.float32)
    dense = [np.ascontiguousarray((t * s).astype(np.float32)) for t, s, _ in layers]

    def numpy_chain():
        y = x
        for w in dense:
            y = y @ w.T
        return y

    variants = [("IREE f32 linalg.matmul (data tiling)", emit_dense, DENSE_FLAGS)]
    for strategy, aq, codes in VARIANTS:
        if (only and strategy not in only) or (only_codes and codes != only_codes):
            continue
        row = STRATEGIES[strategy]
        if row.needs_feature and row.feature not in host_cpu_features():
            continue            # e.g. avx2 on a host without AVX2
        if not row.fits(ternary_types(m, k, n), {"k": k, "n": n}):
            continue            # the kernel does not take this shape
        if codes != STRATEGIES[strategy].codes and codes != "signed":
            continue            # the shape does not fit the kernel that reads them
        recode = to_offset_codes if codes == "offset" else (lambda p: p)
        variants.append((strategy + ("" if aq else " noquant") + f" ({codes} codes)",
                         lambda v, layer, s=strategy, a=aq, c=codes, r=recode:
                         emit_ternary_matmul(v, r(layer[2]), k, n, layer[1], strategy=s,
                                             act_quant=a, codes=c),
                         strategy_flags(strategy)))
    fns = {"numpy f32 x @ W.T": numpy_chain}
    for name, emit_one, flags in variants:
        t0 = time.perf_counter()
        mod = compile_chain(m, k, layers, emit_one, flags)
        label = f"{name}  [compile {time.perf_counter() - t0:.1f}s]"
        xd = mod.on_device(x)
        fns[label] = lambda mod=mod, xd=xd: mod.main(xd).to_host()
    return [(name, med / n_layers, best / n_layers)
            for name, (med, best) in interleaved_medians(fns, rounds).items()]


def print_rows(rows):
    """(label, median s, min s) rows, with ratios to the first row (NumPy)."""
    base, base_min = rows[0][1], rows[0][2]
    print(f"  {'':56s} {'median':>9s} {'ratio':>7s}   {'min':>9s} {'ratio':>7s}")
    for name, med, best in rows:
        print(f"  {name:56s} {med * 1e3:6.3f} ms {med / base:6.2f}x   "
              f"{best * 1e3:6.3f} ms {best / base_min:6.2f}x")
    sys.stdout.flush()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cold", action="store_true",
                    help="distinct 4096x4096 layers chained (weights from DRAM), M=1")
    ap.add_argument("--layers", type=int, default=16, help="layer count for --cold")
    ap.add_argument("--rounds", type=int, default=20,
                    help="turns each kernel gets (5 timed calls per turn)")
    ap.add_argument("--only", default="",
                    help="comma-separated strategies to time (default: all)")
    ap.add_argument("--shapes", default="",
                    help="comma-separated MxKxN shapes (default: "
                         + ",".join("x".join(map(str, s)) for s in SHAPES) + ")")
    ap.add_argument("--codes", default="",
                    help="time only the variants on these 2-bit codes (offset or signed)")
    args = ap.parse_args(argv)
    only = set(filter(None, args.only.split(",")))
    rng = np.random.default_rng(0)
    shapes = ([tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
              if args.shapes else SHAPES)
    shapes = [(1, 4096, 4096)] if args.cold else shapes
    n_layers = args.layers if args.cold else 1
    for m, k, n in shapes:
        print(f"\n{m}x{k}x{n}" + (f"  cold: {n_layers} distinct layers, time per layer"
                                  if args.cold else "")
              + f"   (choose_strategy -> {choose_strategy(m, k, n)})")
        print_rows(run(m, k, n, n_layers, args.rounds, rng, only, args.codes))


if __name__ == "__main__":
    main()
