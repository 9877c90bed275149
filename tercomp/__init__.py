"""tercomp: a compiler for ternary neural networks.

    import tercomp as tc
    g = tc.trace(fn, *example_args)          # tern IR
    exe = tc.compile(fn_or_module, *example_args)
    exe(*arrays)                              # numpy in, numpy out
    exe.save("m.tcm"); tc.load("m.tcm")      # one-file artifacts

With only iree-base-runtime installed (no iree-base-compiler), `import tercomp`
still gives tc.load, CompiledModule and the errors: saved artifacts run.
"""
__version__ = "0.1.0"

from .errors import (TercompError, TraceError, ParseError, VerifyError, CompileError,
                     InputError, ArtifactError, DeviceUnavailable, NumericsError)
from .runtime.module import CompiledModule, DeviceArray
from .runtime.artifact import load
from .runtime.generator import LMGenerator

try:
    import iree.compiler as _iree_compiler
except ImportError:  # a deployment: run saved artifacts only
    _iree_compiler = None


class CompilerMissing(TercompError, AttributeError):
    """A compiler-side name (tc.compile, tc.trace, tc.nn, ...) asked for where only
    iree-base-runtime is installed. An AttributeError too, so hasattr() still works."""


def __getattr__(name):
    # only reached for names this module does not define: all of the compiler side when
    # iree-base-compiler is missing
    if _iree_compiler is None and not name.startswith("__"):
        raise CompilerMissing(f"tc.{name} needs iree-base-compiler, which is not installed "
                              f"(only iree-base-runtime is: saved artifacts load and run "
                              f"with tc.load)",
                              hint="pip install iree-base-compiler, or pip install -e . "
                                   "in the tercomp repository")
    raise AttributeError(f"module 'tercomp' has no attribute {name!r}")

if _iree_compiler is not None:
    from . import ir, ops, passes
    from .trace import trace, spec, Tracer
    from .trace.api import *  # noqa: F401,F403  numpy-named functions
    from .trace.api import sum, max, min, abs  # noqa: A004  (shadow builtins on purpose, as numpy does)
    from . import nn
    from .compiler import compile

    from .transforms import grad, value_and_grad, vjp, jvp, custom_vjp
    from .trace.loops import scan, checkpoint, associative_scan
    from .passes import autodiff as _autodiff  # noqa: F401  registers the autodiff pass
    from . import optim
    from .train import compile_train_step, TrainStep, save_checkpoint, load_checkpoint
    from .generate import compile_lm
