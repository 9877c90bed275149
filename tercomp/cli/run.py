"""`tercomp run`: an artifact on inputs, the results printed (and saved with -o).

    tercomp run ARTIFACT --input INPUT... [--device D] [--threads N] [-o OUT.npz]

INPUT is a .npy file (`x.npy` or `@x.npy`) or iree-run-module's `SHAPExDTYPE=VALUES`.
Needs only the runtime (iree-base-runtime).
"""
from __future__ import annotations

import numpy as np

from ..pytree import flatten
from ..runtime.module import _flat
from .base import UsageError, load_function, parse_input, positive_int


def add_parser(sub):
    """Add the `run` command to the subparsers `sub`."""
    r = sub.add_parser("run", help="run an artifact on inputs and print the results",
                       description="Run an artifact. Inputs: .npy files or SHAPExDTYPE=VALUES "
                                   "(2x3xf32=1,2,3,4,5,6; 4xf32=0 fills; f32=1 is a scalar).")
    r.add_argument("artifact")
    r.add_argument("--input", action="append", default=[], metavar="INPUT", help="one per argument, in order")
    r.add_argument("--device", help="local-task, local-sync, vulkan or cuda (default: the first present)")
    r.add_argument("--threads", type=positive_int, help="local-task thread count")
    r.add_argument("-o", "--output", metavar="FILE.npz", help="also save the results, by output name")
    r.set_defaults(run=run)
    return r


def run(args) -> int:
    inputs = [parse_input(t) for t in args.input]     # bad syntax: before the load
    exe = load_function(args, "run")
    sig = exe.signature
    if (not inputs and sig.inputs) or (_flat(sig.in_tree) and len(inputs) != len(sig.inputs)):
        raise UsageError(f"{'no --input given' if not inputs else f'{len(inputs)} --input given'}; "
                         f"{_input_help(sig)}")
    leaves = flatten(exe(*inputs))[0]
    for sig, value in zip(exe.signature.outputs, leaves):
        _print_result(sig.name, value)
    if args.output:
        try:
            np.savez(args.output, **{s.name: v for s, v in zip(exe.signature.outputs, leaves)})
        except OSError as e:
            raise UsageError(f"cannot write {args.output}: {e.strerror or e}") from None
    return 0


def _print_result(name: str, value) -> None:
    arr = np.asarray(value)
    print(f"{name}: {arr.dtype.name}{list(arr.shape)}")
    with np.printoptions(threshold=200, edgeitems=4, linewidth=100):
        print(arr)


def _input_help(sig) -> str:
    example = " ".join(f"--input {'x'.join(str(d if isinstance(d, int) else 2) for d in t.shape)}"
                       f"{'x' if t.shape else ''}{t.dtype}=0" for t in sig.inputs)
    return (f"{sig.function} takes {len(sig.inputs)} input{'s' if len(sig.inputs) != 1 else ''} "
            f"({', '.join(t.describe() for t in sig.inputs)}): pass one --input per input, in "
            f"order, as a .npy file or SHAPExDTYPE=VALUES, e.g. {example}")
