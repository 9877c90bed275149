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
