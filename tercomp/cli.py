"""The `tercomp` command line.

    tercomp compile FILE.py:OBJ --example SPEC... [--target T]... -o OUT.tcm [--dump DIR]
    tercomp run ARTIFACT --input INPUT... [--device D] [--threads N] [-o OUT.npz]
    tercomp info ARTIFACT [--json]
    tercomp opt FILE.tern.mlir|- --pass NAME [--pass NAME]...
    tercomp bench ARTIFACT [--runs N] [--dim B=8]... [--device D] [--threads N]
    tercomp generate MODEL (--prompt TEXT | --prompt-ids 1,2,3) [-n 64] [--temperature T] ...
    tercomp perplexity MODEL --text FILE [--ctx N] [--bos ID | --no-bos]

OBJ is a function, an nn.Module, or a zero-argument factory of either (a Module
class, say). SPEC is `dims:dtype` with dims comma-separated ints or names of
symbolic dims: `B,784:f32`, `4,8:float32`, `:f32` (a scalar). INPUT is a .npy file
(`x.npy` or `@x.npy`) or iree-run-module's `SHAPExDTYPE=VALUES`: `2x3xf32=1,2,3,4,5,6`,
`4xf32=0` (one value fills the tensor), `f32=1.5` (a scalar).

Errors are one line, `tercomp: error: ...`, and exit status 1 (2 for bad usage);
`-v` shows details and tracebacks. run, info and bench need only iree-base-runtime.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import json
import os
import re
import sys
import threading
import time
import types

import numpy as np

from . import cli_generate, cli_perplexity, cli_serve, dimexpr
from .dtypes import ALIASES, DTYPES, dtype_name, numpy_dtype
from .errors import TercompError

try:    # the strategy table needs iree-base-compiler; without it, compiling is refused anyway
    from .kernels.ternary.strategies import CHOICES as _TERNARY_CHOICES
except ImportError:
    _TERNARY_CHOICES = None



class UsageError(Exception):
    """Bad command-line arguments (exit status 2)."""


def _is_decimal(text: str) -> bool:
    """ASCII digits only: str.isdigit() is also true of '²' and '１２'."""
    return re.fullmatch(r"[0-9]+", text) is not None


class _Parser(argparse.ArgumentParser):
    def error(self, message):        # one line instead of argparse's usage + message
        raise UsageError(f"{message} (see `{self.prog} --help`)")


# -- argument parsing helpers ----------------------------------------------------------

def _dtype(text: str) -> str:
    if text not in DTYPES and text not in ALIASES:
        raise UsageError(f"unknown dtype {text!r}; use one of {', '.join(DTYPES)}")
    return numpy_dtype(dtype_name(text)).name


def parse_spec(text: str):
    """'B,784:f32' -> tc.spec(('B', 784), 'float32')."""
    import tercomp as tc
    dims_text, _, dtype = text.rpartition(":") if ":" in text else (text, "", "f32")
    dims = []
    for d in filter(None, (p.strip() for p in dims_text.split(","))):
        if _is_decimal(d):
            dims.append(int(d))
        elif d.isidentifier():
            dims.append(d)
        else:
            raise UsageError(f"bad dim {d!r} in --example {text!r}: use an int or a name like B")
    return tc.spec(tuple(dims), _dtype(dtype or "f32"))


def parse_input(text: str) -> np.ndarray:
    """A .npy path, '@path.npy', or iree-run-module style '2x3xf32=1,2,3,4,5,6'."""
    if text.startswith("@") or (text.endswith(".npy") and "=" not in text):
        path = text.lstrip("@")
        try:
            return np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise UsageError(f"cannot read the input {path}: {e}") from None
    m = re.fullmatch(r"((?:[0-9]+x)*)([a-z]+[0-9]*)=(.*)", text, re.S)
    if not m:
        raise UsageError(f"bad --input {text!r}: use a .npy file or SHAPExDTYPE=VALUES "
                         "like 2x3xf32=1,2,3,4,5,6")
    shape = tuple(int(d) for d in m.group(1).split("x") if d)
    dtype = np.dtype(_dtype(m.group(2)))
    items = [v for v in re.split(r"[,\s\[\]]+", m.group(3)) if v]
    try:
        values = np.array([float(v) if dtype.kind == "f" else int(float(v)) for v in items], dtype)
    except (ValueError, OverflowError) as e:
        raise UsageError(f"bad value in --input {text[:80]!r}: {e} (values must fit in "
                         f"{dtype.name})") from None
    n = int(np.prod(shape))
    if values.size == 1:
        return np.full(shape, values[0], dtype)
    if values.size != n:
        raise UsageError(f"--input {text!r}: shape {list(shape)} needs {n} values, got {values.size}")
    return values.reshape(shape)


def _load_object(ref: str):
    """'path/to/file.py:name' -> the object (a dotted name reaches attributes)."""
    path, sep, name = ref.rpartition(":")
    if not sep or not path or not name:
        raise UsageError(f"expected FILE.py:OBJECT, got {ref!r}")
    if not os.path.isfile(path):
        raise UsageError(f"no such file: {path}")
    directory = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, directory)            # the file's own imports of its neighbours
    modname = "_tercomp_user_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    spec = importlib.util.spec_from_file_location(modname, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[modname] = module
    try:
        spec.loader.exec_module(module)
    except TercompError:
        raise
    except BaseException as e:               # the user's file: its SystemExit too
        raise TercompError(f"importing {path} failed: {type(e).__name__}: {e}") from None
    obj = module
    for part in name.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"{path} has no {name!r}; {_names_in(obj, path)}")
        obj = getattr(obj, part)
    return obj


def _names_in(obj, path: str) -> str:
    """What FILE.py:NAME could name in `obj` (a module or an object): its public
    callables and nn.Modules, defined there (not imported modules)."""
    names = sorted(n for n, v in getattr(obj, "__dict__", {}).items()
                   if not n.startswith("_") and not isinstance(v, types.ModuleType)
                   and (callable(v) or hasattr(v, "parameters")))
    if not names:
        return "it defines no function, class or nn.Module to compile"
    shown = ", ".join(names[:30]) + (f" and {len(names) - 30} more" if len(names) > 30 else "")
    return f"it defines {shown} (use {path}:NAME)"


def _resolve_compilable(obj, ref: str):
    """A Module or function; a Module class or zero-argument factory is called first."""
    from .nn import Module
    if isinstance(obj, Module):
        return obj
    factory = isinstance(obj, type) or (callable(obj) and _takes_no_args(obj))
    if factory:
        try:
            obj = obj()
        except TercompError:
            raise
        except Exception as e:
            raise TercompError(f"calling the factory {ref}() failed: {type(e).__name__}: {e}") from None
    if not callable(obj):
        raise TercompError(f"{ref} is a {type(obj).__name__}, not a function, nn.Module or factory")
    return obj


def _check_example_count(fn, n: int, ref: str) -> None:
    from .nn import Module
    target = fn.forward if isinstance(fn, Module) else fn
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        return
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if not len(required) <= n <= len(positional):
        names = ", ".join(p.name for p in positional)
        raise UsageError(f"{ref} takes {len(required)} argument(s) ({names}) but {n} --example "
                         "was given: give one --example per argument")


def _takes_no_args(fn) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return not any(p.kind == p.VAR_POSITIONAL or
                   (p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
                   for p in params)


# -- progress ----------------------------------------------------------------------------

@contextlib.contextmanager
def spinner(label: str):
    """A spinner with elapsed seconds on stderr while the block runs (after half a
    second), only when stderr is a terminal. It writes to a duplicate of fd 2 because
    IREE's diagnostics capture redirects fd 2 during a compile."""
    if not sys.stderr.isatty():
        yield
        return
    fd = os.dup(sys.stderr.fileno())
    done = threading.Event()

    def spin():
        start, frames, i = time.monotonic(), "|/-\\", 0
        if done.wait(0.5):                 # short compiles: no flicker
            return
        while not done.wait(0.1):
            os.write(fd, f"\r{frames[i % 4]} {label} {time.monotonic() - start:5.1f}s".encode())
            i += 1
        os.write(fd, b"\r\x1b[K")          # erase the line

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join()
        os.close(fd)


# -- commands ----------------------------------------------------------------------------

def cmd_compile(args) -> int:
    try:
        import tercomp as tc
        tc.compile  # noqa: B018  (missing when only iree-base-runtime is installed)
    except AttributeError:
        raise TercompError("compiling needs iree-base-compiler", hint="pip install iree-base-compiler") from None
    examples = [parse_spec(s) for s in args.example]
    fn = _resolve_compilable(_load_object(args.object), args.object)
    _check_example_count(fn, len(examples), args.object)
    targets = args.target or ["llvm-cpu"]
    with spinner(f"compiling {args.object} for {', '.join(targets)}"):
        exe = tc.compile(fn, *examples, target=targets, dump_dir=args.dump, flags=args.flag,
                         cache=not args.no_cache, vulkan_target=args.vulkan_target,
                         cuda_target=args.cuda_target, ternary=args.ternary, weights=args.weights,
                         isolate=args.isolate)
    exe.save(args.output)
    hit = " (from the compile cache)" if exe.meta.get("cache_hit") else ""
    print(f"wrote {args.output}: {os.path.getsize(args.output)} bytes, "
          f"targets {', '.join(exe.targets)}{hit}", file=sys.stderr)
    return 0


def _print_result(name: str, value) -> None:
    arr = np.asarray(value)
    print(f"{name}: {arr.dtype.name}{list(arr.shape)}")
    with np.printoptions(threshold=200, edgeitems=4, linewidth=100):
        print(arr)


def _load_function(args, command: str):
    """The CompiledModule of args.artifact; a language model is a usage error (its
    command is `tercomp generate`)."""
    from .runtime.loader import load
    exe = load(args.artifact, device=args.device, threads=args.threads)
    if not hasattr(exe, "signature"):
        raise UsageError(f"{args.artifact} is a language model: `tercomp {command}` runs a "
                         f"function; generate with `tercomp generate {args.artifact} --prompt-ids 1,2,3`")
    return exe


def _input_help(sig) -> str:
    example = " ".join(f"--input {'x'.join(str(d if isinstance(d, int) else 2) for d in t.shape)}"
                       f"{'x' if t.shape else ''}{t.dtype}=0" for t in sig.inputs)
    return (f"{sig.function} takes {len(sig.inputs)} input{'s' if len(sig.inputs) != 1 else ''} "
            f"({', '.join(t.describe() for t in sig.inputs)}): pass one --input per input, in "
            f"order, as a .npy file or SHAPExDTYPE=VALUES, e.g. {example}")


def cmd_run(args) -> int:
    from .pytree import flatten
    from .runtime.module import _flat
    inputs = [parse_input(t) for t in args.input]     # bad syntax: before the load
    exe = _load_function(args, "run")
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


def cmd_info(args) -> int:
    from .runtime.artifact import read
    meta, vmfb, weights = read(args.artifact)
    if args.json:
        print(json.dumps({**meta, "file_size": os.path.getsize(args.artifact), "vmfb_size": len(vmfb),
                          "weights_size": len(weights) if weights is not None else 0}, indent=1))
        return 0
    from .runtime.signature import Signature
    sig = Signature.from_json(meta["signature"])
    rows = [
        ("artifact", f"{args.artifact} ({os.path.getsize(args.artifact)} bytes)"),
        ("function", sig.function),
        *[("input", t.describe()) for t in sig.inputs],
        *[("output", t.describe()) for t in sig.outputs],
        ("targets", ", ".join(meta.get("targets", []))),
        ("devices", ", ".join(meta.get("drivers", []))),
        ("ternary", ", ".join(meta.get("ternary") or []) or "none"),
        ("module.vmfb", f"{len(vmfb)} bytes"),
        ("weights.irpa", f"{len(weights)} bytes" if weights is not None else "none"),
        ("tercomp", meta.get("tercomp_version", "?")),
        ("IREE", meta.get("iree_version", "?")),
        ("content hash", meta.get("content_hash", "?")),
        ("flags", " ".join(meta.get("flags", []))),
    ]
    for key, value in rows:
        print(f"{key + ':':14} {value}")
    return 0


def cmd_opt(args) -> int:
    import tercomp as tc
    if not hasattr(tc, "passes"):
        raise TercompError("tercomp opt needs iree-base-compiler", hint="pip install iree-base-compiler")
    from .ir import print_graph
    from .ops import parse
    from .passes import run_pipeline
    from . import autodiff  # noqa: F401  registers the autodiff pass
    if args.file == "-":
        text, filename = sys.stdin.read(), "<stdin>"
    else:
        try:
            with open(args.file) as f:
                text, filename = f.read(), args.file
        except UnicodeDecodeError as e:
            raise UsageError(f"{args.file} is not UTF-8 text (byte {e.start}): tercomp opt reads "
                             "tern IR text (.tern.mlir)") from None
        except (OSError, ValueError) as e:      # ValueError: a NUL in the path
            shown = args.file.replace("\0", "\\0")
            raise UsageError(f"cannot read {shown}: {getattr(e, 'strerror', None) or e}") from None
    graph = run_pipeline(parse(text, filename), args.pass_names or [])
    sys.stdout.write(print_graph(graph, elide=not args.print_constants))
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


def cmd_bench(args) -> int:
    if args.runs < 1 or args.warmup < 0:
        raise UsageError("--runs must be at least 1 and --warmup at least 0")
    dims = {}
    for d in args.dim:
        name, _, value = d.partition("=")
        if not name.isidentifier() or not _is_decimal(value):
            raise UsageError(f"bad --dim {d!r}: use NAME=INT like B=8")
        dims[name] = int(value)
    exe = _load_function(args, "bench")
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


# -- main --------------------------------------------------------------------------------

def _positive_int(text: str) -> int:
    if not _is_decimal(text) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tercomp", description="Compile, inspect and run ternary neural networks.")
    p.add_argument("-v", "--verbose", action="store_true", help="show details and tracebacks on errors")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    c = sub.add_parser("compile", help="compile a Python function or nn.Module into an artifact",
                       description="Compile FILE.py:OBJ (a function, an nn.Module or a zero-argument "
                                   "factory of either) into one artifact file.")
    c.add_argument("object", metavar="FILE.py:OBJ")
    c.add_argument("--example", action="append", default=[], metavar="SPEC",
                   help="one per argument: dims:dtype, e.g. B,784:f32 (B symbolic) or 4,8:float32")
    c.add_argument("--target", action="append", metavar="T",
                   help="llvm-cpu (default), llvm-cpu-generic, vulkan, cuda; repeat for several in one artifact")
    c.add_argument("--vulkan-target", metavar="NAME", help="Vulkan target, default vp_android_baseline_2022")
    c.add_argument("--cuda-target", metavar="NAME", help="CUDA target, default sm_80")
    c.add_argument("-o", "--output", required=True, metavar="OUT", help="artifact file to write (.tcm)")
    c.add_argument("--dump", metavar="DIR", help="write every compile stage to DIR")
    c.add_argument("--flag", action="append", default=[], metavar="FLAG", help="extra IREE compiler flag")
    c.add_argument("--no-cache", action="store_true", help="do not use the compile cache")
    c.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="run IREE in a subprocess, so a compiler crash becomes an error message "
                        "(default: for GPU targets and extra --flag only)")
    c.add_argument("--ternary", default="auto", choices=_TERNARY_CHOICES,
                   help="ternary matmul kernels for BitLinear layers (default auto: per target "
                        "and shape; see tercomp/kernels/table.py)")
    c.add_argument("--weights", default="auto", choices=["auto", "inline", "irpa"],
                   help="weights inline in the module or as .irpa parameters (default auto)")
    c.set_defaults(run=cmd_compile)

    r = sub.add_parser("run", help="run an artifact on inputs and print the results",
                       description="Run an artifact. Inputs: .npy files or SHAPExDTYPE=VALUES "
                                   "(2x3xf32=1,2,3,4,5,6; 4xf32=0 fills; f32=1 is a scalar).")
    r.add_argument("artifact")
    r.add_argument("--input", action="append", default=[], metavar="INPUT", help="one per argument, in order")
    r.add_argument("--device", help="local-task, local-sync, vulkan or cuda (default: the first present)")
    r.add_argument("--threads", type=_positive_int, help="local-task thread count")
    r.add_argument("-o", "--output", metavar="FILE.npz", help="also save the results, by output name")
    r.set_defaults(run=cmd_run)

    i = sub.add_parser("info", help="show an artifact's signature, targets, sizes and versions")
    i.add_argument("artifact")
    i.add_argument("--json", action="store_true", help="print signature.json and sizes as JSON")
    i.set_defaults(run=cmd_info)

    o = sub.add_parser("opt", help="run passes on a tern IR file and print the result",
                       description="Parse FILE (tern IR; - reads stdin), run the passes in order, print.")
    o.add_argument("file", metavar="FILE.tern.mlir")
    o.add_argument("--pass", dest="pass_names", action="append", metavar="NAME", help="a pass to run")
    o.add_argument("--print-constants", action="store_true", help="print large constants in full")
    o.set_defaults(run=cmd_opt)

    b = sub.add_parser("bench", help="time an artifact on random inputs",
                       description="Median time of an artifact's function on random inputs.")
    b.add_argument("artifact")
    b.add_argument("--runs", type=int, default=20, help="timed runs (default 20)")
    b.add_argument("--warmup", type=int, default=2, help="untimed runs first (default 2)")
    b.add_argument("--dim", action="append", default=[], metavar="NAME=N", help="bind a symbolic dim, e.g. B=8")
    b.add_argument("--device", help="local-task, local-sync, vulkan or cuda (default: the first present)")
    b.add_argument("--threads", type=_positive_int, help="local-task thread count")
    b.set_defaults(run=cmd_bench)

    cli_generate.add_parser(sub, _positive_int,
                            lambda args: cli_generate.run(args, spinner, UsageError))
    cli_serve.add_parser(sub, _positive_int, lambda args: cli_serve.run(args, spinner, UsageError))
    cli_perplexity.add_parser(sub, _positive_int,
                              lambda args: cli_perplexity.run(args, spinner, UsageError))
    return p


def _one_line(e: TercompError) -> str:
    lines = [line.strip() for line in e.message.strip().splitlines() if line.strip()]
    text = " ".join(lines) or type(e).__name__
    if len(text) > 300:                    # IREE's diagnostics: the first line, -v for all
        text = lines[0] + " (-v shows the details)"
    elif e.hint:
        text += f" (hint: {e.hint})"
    if e.loc is not None and str(e.loc):
        text = f"{e.loc}: {text}"
    return text


def main(argv=None) -> int:
    """Entry point of the `tercomp` console script; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    verbose = "-v" in argv or "--verbose" in argv
    try:
        args = build_parser().parse_args(argv)
        if args.command is None:
            raise UsageError("a command is required: compile, run, info, opt, bench, generate, serve or perplexity "
                             "(see `tercomp --help`)")
        return args.run(args)
    except UsageError as e:
        print(f"tercomp: error: {e}", file=sys.stderr)
        return 2
    except TercompError as e:
        print(f"tercomp: error: {_one_line(e)}", file=sys.stderr)
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


if __name__ == "__main__":
    sys.exit(main())
