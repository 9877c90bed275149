"""tercomp: a compiler for ternary neural networks.

    import tercomp as tc
    g = tc.trace(fn, *example_args)          # tern IR
    exe = tc.compile(fn_or_module, *example_args)
    exe(*arrays)                              # numpy in, numpy out
"""
from .errors import (TercompError, TraceError, ParseError, VerifyError, CompileError,
                     InputError, ArtifactError, DeviceUnavailable)
from . import ir, ops, passes
from .trace import trace, spec, Tracer
from .trace.api import *  # noqa: F401,F403  numpy-named functions
from .trace.api import sum, max, min, abs  # noqa: A004  (shadow builtins on purpose, as numpy does)
from . import nn
from .compiler import compile
from .runtime.module import CompiledModule

__version__ = "0.1.0"
from .transforms import grad, value_and_grad, vjp, jvp, custom_vjp
from .passes import autodiff as _autodiff  # noqa: F401  registers the autodiff pass
