"""tercomp: a compiler for ternary neural networks.

    import tercomp as tc
    g = tc.trace(fn, *example_args)          # tern IR
    exe = tc.compile(fn_or_module, *example_args)
    exe(*arrays)                              # numpy in, numpy out
    exe.save("m.tcm"); tc.load("m.tcm")      # one-file artifacts

With only iree-base-runtime installed (no iree-base-compiler), `import tercomp`
still gives tc.load, CompiledModule and the errors: saved artifacts run. The compiler
side (tc.compile, tc.trace, tc.nn, the numpy-named functions, ...) is imported on first
use, so a process that only runs artifacts does not load IREE's compiler or sympy.
"""
from ._version import __version__  # noqa: F401

import importlib
import importlib.util

from .errors import (TercompError, TraceError, ParseError, TypeSpecError, VerifyError,
                     CompileError, ConfigError, InputError, ModelFileError, ArtifactError,
                     UnsupportedError, MissingDependency, DeviceUnavailable, ExecutionError,
                     NumericsError, InternalError)
from .runtime.module import CompiledModule, DeviceArray
from .runtime.loader import load
from .runtime.generator import LMGenerator
from .runtime.batched import BatchedLMGenerator

class CompilerMissing(MissingDependency, AttributeError):
    """A compiler-side name (tc.compile, tc.trace, tc.nn, ...) asked for where only
    iree-base-runtime is installed. An AttributeError too, so hasattr() still works."""


def _load_compiler_side() -> None:
    """Import the compiler side (IREE's MLIR bindings and sympy, ~110 MiB of resident
    memory) into this module. Done on first use of a compiler-side name, so a process
    that only loads and runs artifacts (tc.load) never pays for it."""
    from . import ir, ops, passes  # noqa: F401
    from .tracing import trace, spec, Tracer  # noqa: F401
    from .tracing import api as _api
    from .tracing.api import sum, max, min, abs  # noqa: F401,A004  (shadow builtins, as numpy does)
    from . import nn  # noqa: F401
    from .compiler import compile  # noqa: F401
    from .autodiff import grad, value_and_grad, vjp, jvp, custom_vjp  # noqa: F401
    from .tracing.control_flow import scan, checkpoint, associative_scan  # noqa: F401
    from . import optim  # noqa: F401
    from .training import compile_train_step, TrainStep, save_checkpoint, load_checkpoint  # noqa: F401
    from .generate import compile_lm  # noqa: F401
    from .embed import compile_embed  # noqa: F401
    names = {k: v for k, v in locals().items() if not k.startswith("_")}
    names.update({k: getattr(_api, k) for k in getattr(_api, "__all__", dir(_api))
                  if not k.startswith("_")})
    globals().update(names)


def _require_compiler_side(name: str) -> None:
    """Load the compiler side for `tc.<name>`, or say what to install."""
    try:
        import iree.compiler  # noqa: F401
    except ImportError:
        raise CompilerMissing(f"tc.{name} needs iree-base-compiler, which is not installed "
                              f"(only iree-base-runtime is: saved artifacts load and run "
                              f"with tc.load)",
                              hint="pip install iree-base-compiler, or pip install -e . "
                                   "in the tercomp repository") from None
    _load_compiler_side()


def __getattr__(name):
    # only reached for names this module does not define yet: a subpackage (tc.nn, or
    # `from . import nn` inside tercomp) is imported alone, so that a module half-way
    # through its own imports does not pull in the whole compiler side; any other name
    # loads the compiler side (or says what to install when iree-base-compiler is missing)
    if name.startswith("__"):
        raise AttributeError(f"module 'tercomp' has no attribute {name!r}")
    try:
        if importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f"{__name__}.{name}")
    except ImportError:     # only the compiler side needs more than iree-base-runtime
        _require_compiler_side(name)
    _require_compiler_side(name)
    if name in globals():
        return globals()[name]
    raise AttributeError(f"module 'tercomp' has no attribute {name!r}")
