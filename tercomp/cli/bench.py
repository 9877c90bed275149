"""`tercomp bench`: the median time of an artifact's function on random inputs.

    tercomp bench ARTIFACT [--runs N] [--warmup N] [--dim B=8]... [--device D] [--threads N]

Needs only the runtime (iree-base-runtime).
"""
from __future__ import annotations

import time

import numpy as np

from .. import dimexpr
from ..dtypes import numpy_dtype
from ..errors import TercompError
from .base import UsageError, is_decimal, load_function, positive_int


def add_parser(sub):
    """Add the `bench` command to the subparsers `sub`."""
    b = sub.add_parser("bench", help="time an artifact on random inputs",
                       description="Median time of an artifact's function on random inputs.")
    b.add_argument("artifact")
    b.add_argument("--runs", type=int, default=20, help="timed runs (default 20)")
    b.add_argument("--warmup", type=int, default=2, help="untimed runs first (default 2)")
    b.add_argument("--dim", action="append", default=[], metavar="NAME=N", help="bind a symbolic dim, e.g. B=8")
    b.add_argument("--device", help="local-task, local-sync, vulkan or cuda (default: the first present)")
    b.add_argument("--threads", type=positive_int, help="local-task thread count")
    b.set_defaults(run=run)
    return b


def run(args) -> int:
    if args.runs < 1 or args.warmup < 0:
        raise UsageError("--runs must be at least 1 and --warmup at least 0")
    dims = {}
    for d in args.dim:
        name, _, value = d.partition("=")
        if not name.isidentifier() or not is_decimal(value):
            raise UsageError(f"bad --dim {d!r}: use NAME=INT like B=8")
        dims[name] = int(value)
    exe = load_function(args, "bench")
    inputs = _random_inputs(exe.signature, dims, np.random.default_rng(0))
    for _ in range(args.warmup):
        exe(*inputs)
    times = []
    for _ in range(args.runs):
        start = time.perf_counter()
        exe(*inputs)
        times.append(time.perf_counter() - start)
    ms = np.array(times) * 1e3
    shapes = ", ".join(f"{t.name}{list(x.shape)}" for t, x in zip(exe.signature.inputs, inputs))
    print(f"{args.artifact} on {exe.device}: {shapes}")
    print(f"median {np.median(ms):.3f} ms, min {ms.min():.3f} ms, mean {ms.mean():.3f} ms "
          f"over {args.runs} runs")
    return 0


def _random_inputs(sig, dims: dict, rng) -> list:
    out = []
    for t in sig.inputs:
        shape = []
        for d in t.shape:
            if isinstance(d, int):
                shape.append(d)
            elif d in dims:
                shape.append(dims[d])
            else:
                try:        # a dim computed from symbols, such as 2*B
                    shape.append(dimexpr.evaluate(dimexpr.parse(d), dims))
                except (KeyError, TercompError):
                    need = sorted(dimexpr.names(dimexpr.parse(d)) - set(dims))
                    example = " ".join(f"--dim {n}=8" for n in need) or "--dim B=8"
                    raise UsageError(f"input {t.name} has the symbolic dim {d}: give its size with "
                                     f"--dim NAME=INT, e.g. {example}") from None
        dtype = numpy_dtype(t.dtype)
        if dtype.kind == "f":
            out.append(rng.standard_normal(shape).astype(dtype))
        elif dtype.kind == "b":
            out.append(rng.integers(0, 2, shape).astype(bool))
        else:
            out.append(rng.integers(-8, 8, shape).astype(dtype))
    return out
