"""Time the LM output layer's hand-written kernel (`kernels.dense.widening_avx2`) at the
700M shape (N = 32002, K = 1536), variants of its rows-of-x block (`m_block`) and of
its final sums, f16 and int8 tables, one process, turns interleaved
(`bench.ternary_kernels.interleaved_medians`), wall and process CPU time:

    python bench/output_layer.py [--variants 4:ordered,8 --rows 1,8,128 --rounds 8]
    python bench/output_layer.py --variants 4,vnni --dtypes int8   (the avx512-vnni row)

Each compiled module takes the table as a run-time argument already on the device, so
a call reads the whole table from memory (98 MB f16 / 49 MB int8: no cache holds it).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import iree.runtime as rt
from ternary_kernels import interleaved_medians

import tercomp as tc
from tercomp.kernels.dense import widening_avx2
from tercomp.ternary_pack import act_quant
from tercomp.tracing.tracer import apply

N, K = 32002, 1536


def build(variant: str, el: str, dump: str | None):
    """A module y = x @ f32(w)^T (* scale) for `variant`: "MB" (widening_avx2.m_block() ==
    MB), "MB:ordered" (its sums reduced in lane order, as before fastmath<reassoc>) or
    "vnni" (the int8 table's avx512-vnni row: x quantized to int8, vpdpbusd)."""
    if variant == "vnni":
        specs = [tc.spec(("M", K), "float32"), tc.spec((N, K), el), tc.spec((N,), "float32")]
        flags = [f"--iree-hal-dump-executable-files-to={dump}"] if dump else []
        return tc.compile(lambda x, w, s: apply("widening_matmul", x, w, s, kernel="avx512-vnni"),
                          *specs, cache=False, threads=2, flags=flags)
    mb, _, ordered = variant.partition(":")
    saved, saved_text = widening_avx2.m_block, widening_avx2.executable_text
    widening_avx2.m_block = lambda: int(mb)
    if ordered:
        widening_avx2.executable_text = lambda *a: saved_text(*a).replace(" fastmath<reassoc>", "")
    try:
        specs = [tc.spec(("M", K), "float32"), tc.spec((N, K), el)]
        if el == "int8":
            specs.append(tc.spec((N,), "float32"))
        flags = [f"--iree-hal-dump-executable-files-to={dump}"] if dump else []
        return tc.compile(lambda x, w, *s: apply("widening_matmul", x, w, *s, kernel="avx2"),
                          *specs, cache=False, threads=2, flags=flags)
    finally:
        widening_avx2.m_block, widening_avx2.executable_text = saved, saved_text


def timed(mod, dev, cpu: list):
    """One call; its process CPU time (all threads) appended to `cpu`: on a shared machine
    less sensitive than wall time to the workers being descheduled (the first 2, the
    warm-up calls of interleaved_medians, are left out of the median)."""
    c0 = time.process_time()
    mod(*dev)
    cpu.append(time.process_time() - c0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="4:ordered,4",
                    help="MB or MB:ordered, comma-separated (4:ordered: the sums in lane "
                         "order, the kernel before the tree; MB > 4 spills with 4 weight "
                         "rows a step)")
    ap.add_argument("--rows", default="1,8,128")
    ap.add_argument("--dtypes", default="int8,float16")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--dump", default=None, help="dump each executable under DIR/<mb>_<dtype>")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    for el in args.dtypes.split(","):
        w = (rng.integers(-127, 128, (N, K)).astype(np.int8) if el == "int8"
             else rng.standard_normal((N, K)).astype(np.float16))
        extra = [rng.uniform(0.5, 2, N).astype(np.float32)] if el == "int8" else []
        mods = {v: build(v, el, args.dump and os.path.join(args.dump, f"{v}_{el}"))
                for v in args.variants.split(",") if v != "vnni" or el == "int8"}
        for m in map(int, args.rows.split(",")):
            x = rng.standard_normal((m, K)).astype(np.float32)
            ref = (x.astype(np.float64) @ w.astype(np.float64).T) * (extra[0] if extra else 1)
            xq, qs = act_quant(x)
            ref_q = (xq.astype(np.float64) @ w.astype(np.float64).T) / qs * (extra[0] if extra else 1)
            fns, cpu = {}, {v: [] for v in mods}
            for mb, mod in mods.items():
                mod._load()
                dev = [rt.asdevicearray(mod._hal_device, a) for a in [x, w, *extra]]
                y = np.asarray(mod(*dev))
                r = ref_q if mb == "vnni" else ref
                np.testing.assert_allclose(y, r, rtol=1e-3, atol=1e-3 * np.abs(r).max())
                fns[mb] = lambda mod=mod, dev=dev, cpu=cpu[mb]: timed(mod, dev, cpu)
            res = interleaved_medians(fns, args.rounds, calls=5)
            line = "  ".join(f"{k}: {md * 1e3:.2f} / {mn * 1e3:.2f} (CPU {np.median(cpu[k][2:]) * 1e3:.2f})"
                             for k, (md, mn) in res.items())
            print(f"{el} M={m}: median / min wall ms (median CPU ms)  {line}", flush=True)


if __name__ == "__main__":
    main()
