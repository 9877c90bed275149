"""How much of a language model's decode step is dispatch overhead (issue #25: would fusing
RMSNorm + activation quantize + matmul into fewer dispatches pay?).

    python bench/dispatch_overhead.py                  # bench/lm.py's 700M shape (24 layers)
    python bench/dispatch_overhead.py --layers 4 --extra 8
    python bench/dispatch_overhead.py --model m.gguf   # a GGUF of your own

Two measurements, IREE local-task with --threads (2) threads:

- chain: one module of N chained hand-written dispatches, each adding 1 to a [1536] f32
  row in 1 or 8 workgroups, at N = 32 and 512 (calls interleaved): the slope is what one
  dispatch and its barrier cost inside one command buffer (a decode step is one command
  buffer of all its dispatches).
- model: the LM compiled as is and with every RMSNorm dispatched 1 + --extra times (the
  extra dispatches chained on the norm's output: one-workgroup row kernels like the
  quantize dispatch a norm + quantize fusion would remove), decode steps at position 64
  of both taken in turns in one process, once in each load order (the module loaded
  first measures slowest). The step time added, over the dispatches added, bounds one
  dispatch's cost from above (its own small work included); times the step's dispatch
  count, the share of the step.
"""
from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import iree.compiler as ic  # noqa: E402
import iree.runtime as rt  # noqa: E402

import lm  # noqa: E402  (bench/lm.py: the model file)
import tercomp as tc  # noqa: E402
from tercomp import models  # noqa: E402
from tercomp.kernels.rows import rows_cpu  # noqa: E402
from tercomp.runtime.devices import open_device  # noqa: E402

N = 1536


# ---------------------------------------------------------------------------- chain
def chain_module(n: int, groups: int) -> str:
    per = N // groups
    exe = f"""
stream.executable private @k {{
  stream.executable.export public @k workgroups(%m: index) -> (index, index, index) {{
    %c1 = arith.constant 1 : index
    %g = arith.constant {groups} : index
    stream.return %g, %c1, %c1 : index, index, index
  }}
  builtin.module {{
    func.func @k(%bx: !stream.binding, %bo: !stream.binding, %m: index) {{
      %c0 = arith.constant 0 : index
      %c8 = arith.constant 8 : index
      %cper = arith.constant {per} : index
      %one = arith.constant dense<1.0> : vector<8xf32>
      %wg = stream.dispatch.workgroup.id[0] : index
      %lo = arith.muli %wg, %cper : index
      %hi = arith.addi %lo, %cper : index
      %x = stream.binding.subspan %bx[%c0] : !stream.binding -> memref<{N}xf32>
      %o = stream.binding.subspan %bo[%c0] : !stream.binding -> memref<{N}xf32>
      scf.for %c = %lo to %hi step %c8 {{
        %v = vector.load %x[%c] : memref<{N}xf32>, vector<8xf32>
        %a = arith.addf %v, %one : vector<8xf32>
        vector.store %a, %o[%c] : memref<{N}xf32>, vector<8xf32>
      }}
      return
    }}
  }}
}}
"""
    body = ["%c1 = arith.constant 1 : index",
            f"%v0 = util.optimization_barrier %x : tensor<{N}xf32>"]
    body += [f"%v{i + 1} = flow.dispatch @k::@k[%c1](%v{i}, %c1) : (tensor<{N}xf32>, index) "
             f"-> tensor<{N}xf32>" for i in range(n)]
    body.append(f"return %v{n} : tensor<{N}xf32>")
    return exe + f"func.func @main(%x: tensor<{N}xf32>) -> tensor<{N}xf32> {{\n  " + \
        "\n  ".join(body) + "\n}\n"


def chain(threads: int, rounds: int):
    cfg = rt.Config(device=open_device(f"local-task?threads={threads}").device)
    x = np.zeros(N, np.float32)
    calls = {}
    for groups in (1, 8):
        for n in (32, 512):
            vmfb = ic.compile_str(chain_module(n, groups), target_backends=["llvm-cpu"],
                                  extra_args=["--iree-llvmcpu-target-cpu=host"])
            ctx = rt.SystemContext(config=cfg)
            ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, vmfb))
            f = ctx.modules.module["main"]
            assert np.asarray(f(x).to_host())[0] == n
            calls[groups, n] = f
    times = {k: [] for k in calls}
    for _ in range(rounds):
        for k, f in calls.items():
            t = time.perf_counter()
            np.asarray(f(x).to_host())
            times[k].append(time.perf_counter() - t)
    for groups in (1, 8):
        per = {s.__name__: (s(times[groups, 512]) - s(times[groups, 32])) / 480 * 1e6
               for s in (statistics.median, min)}
        print(f"chain, {groups} workgroup(s) a dispatch: 32 dispatches "
              f"{statistics.median(times[groups, 32]) * 1e3:.3f} ms, 512 "
              f"{statistics.median(times[groups, 512]) * 1e3:.3f} ms (median); per dispatch "
              f"{per['median']:.2f} us (median) / {per['min']:.2f} us (min)")


# ---------------------------------------------------------------------------- model
def compile_step(model: str, threads: int, extra: int, out: str) -> int:
    """Compile `model` (every RMSNorm dispatched 1 + extra times) to `out`; its step's
    dispatch count."""
    plain = rows_cpu.rms_norm

    def chained(x, w, eps, rows):
        for _ in range(extra):
            x = plain(x, w, eps, rows)
        return plain(x, w, eps, rows)
    rows_cpu.rms_norm = chained
    try:
        with tempfile.TemporaryDirectory() as dump:
            gen = tc.compile_lm(models.load(model), threads=threads, output_dtype="float16",
                                cache=False, dump_dir=dump)
            flows = glob.glob(os.path.join(dump, "step", "iree", "*.flow.mlir"))
            with open(flows[0]) as f:
                count = f.read().count("flow.dispatch @")
    finally:
        rows_cpu.rms_norm = plain
    gen.save(out)
    return count


def steps(paths, threads: int, rounds: int) -> list[list[float]]:
    gens = [tc.load(p, threads=threads) for p in paths]
    prompt = np.random.default_rng(1).integers(0, 32000, 64).astype(np.int32)
    for g in gens:
        g.prefill(prompt)
    times = [[] for _ in gens]
    for _ in range(rounds):
        for g, ts in zip(gens, times):
            g.position = 64             # the same row rewritten: the same work every step
            t = time.perf_counter()
            g.decode(int(prompt[0]))
            ts.append(time.perf_counter() - t)
    return times


def model_overhead(model: str, threads: int, extra: int, rounds: int, workdir: str):
    base, more = os.path.join(workdir, "base.tcm"), os.path.join(workdir, "extra.tcm")
    n_base = compile_step(model, threads, 0, base)
    n_more = compile_step(model, threads, extra, more)
    added = n_more - n_base
    print(f"model: {n_base} dispatches a decode step; with {extra} extra per RMSNorm {n_more}")
    stats = (min, lambda t: sorted(t)[len(t) // 10], statistics.median)
    names = ("min", "p10", "median")
    diffs = {n: [] for n in names}
    for order in ((base, more), (more, base)):
        t = dict(zip(order, steps(order, threads, rounds)))
        row = []
        for name, s in zip(names, stats):
            b, m = s(t[base]), s(t[more])
            diffs[name].append((b, m - b))
            row.append(f"{name} {b * 1e3:.2f} -> {m * 1e3:.2f} ms")
        print(f"  {'as is first' if order[0] == base else 'extra first'}: " + ", ".join(row))
    for name in names:
        step = statistics.mean(b for b, _ in diffs[name])
        per = statistics.mean(d for _, d in diffs[name]) / added
        print(f"  {name}: {per * 1e6:.2f} us a dispatch (both orders' mean); "
              f"{n_base} dispatches = {per * n_base * 1e3:.2f} ms of a {step * 1e3:.2f} ms step "
              f"({100 * per * n_base / step:.1f}%)")


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a GGUF (default: bench/lm.py's random model of the shape)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--extra", type=int, default=24, help="extra dispatches per RMSNorm")
    p.add_argument("--rounds", type=int, default=600, help="decode steps of each module per order")
    p.add_argument("--chain-rounds", type=int, default=200)
    a = p.parse_args()
    chain(a.threads, a.chain_rounds)
    with tempfile.TemporaryDirectory(prefix="tercomp-dispatch-") as d:
        model = a.model
        if model is None:
            model = os.path.join(d, "model.gguf")
            lm.write_model(model, SimpleNamespace(hidden=1536, ffn=4096, vocab=32002,
                                                  layers=a.layers, heads=16, kv_heads=0,
                                                  arch="bitnet"))
        model_overhead(model, a.threads, a.extra, a.rounds, d)


if __name__ == "__main__":
    main()
