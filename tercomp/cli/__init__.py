"""The `tercomp` command line.

    tercomp compile FILE.py:OBJ --example SPEC... [--target T]... -o OUT.tcm [--dump DIR]
    tercomp run ARTIFACT --input INPUT... [--device D] [--threads N] [-o OUT.npz]
    tercomp info ARTIFACT [--json]
    tercomp opt FILE.tern.mlir|- --pass NAME [--pass NAME]...
    tercomp bench ARTIFACT [--runs N] [--dim B=8]... [--device D] [--threads N]
    tercomp generate MODEL (--prompt TEXT | --prompt-ids 1,2,3) [-n 64] [--temperature T] ...
    tercomp perplexity MODEL --text FILE [--ctx N] [--bos ID | --no-bos]
    tercomp embed MODEL (--text TEXT | --ids 1,2,3)... [--pooling last|mean|cls] [--cosine]

OBJ is a function, an nn.Module, or a zero-argument factory of either (a Module
class, say). SPEC is `dims:dtype` with dims comma-separated ints or names of
symbolic dims: `B,784:f32`, `4,8:float32`, `:f32` (a scalar). INPUT is a .npy file
(`x.npy` or `@x.npy`) or iree-run-module's `SHAPExDTYPE=VALUES`: `2x3xf32=1,2,3,4,5,6`,
`4xf32=0` (one value fills the tensor), `f32=1.5` (a scalar).

Errors are one line, `tercomp: error: ...`, and exit status 1 (2 for bad usage);
`-v` shows details and tracebacks. run, info and bench need only iree-base-runtime.

One module per command (`compile.py`, `run.py`, ...: `add_parser(sub)` and `run(args)`)
on a shared `base.py`; `model.py` opens the model of generate, serve and perplexity.
Importing this package and building the parser load neither IREE's compiler nor
sympy: a command imports the compiler side when it runs, if it needs it.
"""
from __future__ import annotations

import sys

from ..errors import TercompError
from . import bench, compile, embed, generate, info, opt, perplexity, run, serve
from .base import Parser, UsageError, one_line, parse_input, parse_spec, spinner

__all__ = ["UsageError", "build_parser", "main", "parse_input", "parse_spec", "spinner"]

#: the commands, in the order `tercomp --help` lists them
COMMANDS = (compile, run, info, opt, bench, generate, serve, perplexity, embed)


def build_parser() -> Parser:
    """The `tercomp` argument parser: each command's arguments, and `run` set to the
    function that executes it.

    >>> build_parser().parse_args(["info", "m.tcm"]).artifact
    'm.tcm'
    """
    p = Parser(prog="tercomp", description="Compile, inspect and run ternary neural networks.")
    p.add_argument("-v", "--verbose", action="store_true", help="show details and tracebacks on errors")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for command in COMMANDS:
        command.add_parser(sub)
    return p


def main(argv=None) -> int:
    """Entry point of the `tercomp` console script; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    verbose = "-v" in argv or "--verbose" in argv
    try:
        args = build_parser().parse_args(argv)
        if args.command is None:
            raise UsageError("a command is required: compile, run, info, opt, bench, generate, serve, "
                             "perplexity or embed (see `tercomp --help`)")
        return args.run(args)
    except UsageError as e:
        print(f"tercomp: error: {e}", file=sys.stderr)
        return 2
    except TercompError as e:
        print(f"tercomp: error: {one_line(e)}", file=sys.stderr)
        if verbose:
            print(str(e), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tercomp: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 1
    except Exception as e:  # a bug in tercomp: still one line unless -v
        first = (str(e).splitlines() or [""])[0]
        print(f"tercomp: error: internal error: {type(e).__name__}: {first} "
              "(run with -v for the traceback)", file=sys.stderr)
        if verbose:
            import traceback
            traceback.print_exc()
        return 1
