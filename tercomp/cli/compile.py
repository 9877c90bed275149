"""`tercomp compile`: a Python function or nn.Module into one artifact file.

    tercomp compile FILE.py:OBJ --example SPEC... [--target T]... -o OUT.tcm [--dump DIR]

OBJ is a function, an nn.Module, or a zero-argument factory of either (a Module
class, say). The compiler side is imported when the command runs.
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import re
import sys
import types

from ..errors import TercompError, ConfigError, MissingDependency
from .base import LazyChoices, UsageError, parse_spec, spinner


def _ternary_choices():
    # the strategy table needs iree-base-compiler; without it, compiling is refused anyway
    from ..kernels.ternary.strategies import CHOICES
    return CHOICES


def add_parser(sub):
    """Add the `compile` command to the subparsers `sub`."""
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
    ternary = c.add_argument("--ternary", default="auto",
                             help="ternary matmul kernels for BitLinear layers (default auto: per "
                                  "target and shape; see tercomp/kernels/table.py)")
    # read from the strategy table when checked or shown, not when the parser is built
    # (the table loads IREE's compiler, which `tercomp run` and the others never need)
    ternary.choices = LazyChoices(_ternary_choices)
    c.add_argument("--weights", default="auto", choices=["auto", "inline", "irpa"],
                   help="weights inline in the module or as .irpa parameters (default auto)")
    c.set_defaults(run=run)
    return c


def run(args) -> int:
    try:
        import tercomp as tc
        tc.compile  # noqa: B018  (missing when only iree-base-runtime is installed)
    except AttributeError:
        raise MissingDependency("compiling needs iree-base-compiler", hint="pip install iree-base-compiler") from None
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
        raise ConfigError(f"importing {path} failed: {type(e).__name__}: {e}") from None
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
    from ..nn import Module
    if isinstance(obj, Module):
        return obj
    factory = isinstance(obj, type) or (callable(obj) and _takes_no_args(obj))
    if factory:
        try:
            obj = obj()
        except TercompError:
            raise
        except Exception as e:
            raise ConfigError(f"calling the factory {ref}() failed: {type(e).__name__}: {e}") from None
    if not callable(obj):
        raise ConfigError(f"{ref} is a {type(obj).__name__}, not a function, nn.Module or factory")
    return obj


def _check_example_count(fn, n: int, ref: str) -> None:
    from ..nn import Module
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
