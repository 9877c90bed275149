"""Every error tercomp raises derives from TercompError.

Errors say what was wrong, where in the user's code (a SourceLoc when one is known) and
what to do about it. Each is raised as the most specific class below, so a caller can
catch the kind it handles (as with PyTorch's and JAX's error classes) and `except
TercompError` still catches them all:

    TercompError
    ├── TraceError          tracing user code: shapes, dtypes, control flow, a function's
    │                       return structure (tc.scan, grad, a loss_fn)
    ├── ParseError          tern IR text (line and column)
    ├── TypeSpecError       a shape or dtype tercomp cannot represent      (a ValueError)
    ├── VerifyError         IR that breaks an op's rule
    ├── CompileError        IREE rejected the module (the stage and its diagnostics)
    ├── ConfigError         an option, argument or configuration tercomp does not accept:
    │                       an unknown name (target, pass, kernel, pooling), a number out of
    │                       range, an object of the wrong kind, options that contradict each
    │                       other, a model configuration field      (a ValueError)
    ├── InputError          data that does not match what it is given to: a compiled
    │                       module's arguments, token ids, a state dict, packed weights
    ├── ModelFileError      a model file (GGUF, Hugging Face safetensors or config) that
    │                       cannot be read as a model; names the file and the key or tensor
    │                       (models.GGUFError and models.CheckpointError are its kinds)
    ├── ArtifactError       a saved .tcm or training checkpoint: missing, damaged, or from
    │                       another version
    ├── UnsupportedError    something tercomp, the target, the host or the model does not
    │                       have: an op without a gradient rule, a kernel a target cannot
    │                       build, a model save_gguf cannot write, a model with no tokenizer
    ├── MissingDependency   an optional package that is not installed (tc.CompilerMissing
    │                       is its kind)
    ├── DeviceUnavailable   the requested device is not present
    ├── ExecutionError      running failed for a reason not in the arguments: the IREE
    │                       runtime or the NumPy reference failed, another rank of a
    │                       data-parallel job failed, a call would break a running one
    │                       (a RuntimeError)
    ├── NumericsError       a NaN or Inf (check_numerics, a training step's on_nan)
    └── InternalError       a bug in tercomp: an invariant of its own broke; please report it

`except ValueError` keeps catching the classes marked as ValueErrors, as it would for
NumPy's or Python's own errors about a bad value.
"""
from __future__ import annotations

import math
import numbers
import sys


def _check_not_shadowed() -> None:
    """A folder named `tercomp` (without __init__.py) beside a user's script makes
    `import tercomp` give an empty namespace package instead of this one when tercomp is
    installed in editable mode (setuptools' finder runs after the path search). None of
    tercomp's code runs then, so `tc.trace` is a bare AttributeError that nothing here can
    catch; but a submodule (`from tercomp import nn`) still loads, and they all import this
    module first: say what happened instead of failing further on."""
    pkg = sys.modules.get(__package__ or "")
    if pkg is not None and getattr(pkg, "__file__", None) is None:
        where = ", ".join(dict.fromkeys(str(p) for p in getattr(pkg, "__path__", [])))
        raise ImportError(f"'{__package__}' was imported from the folder {where}, which is not the "
                          f"tercomp package (it has no __init__.py): it shadows the installed one. "
                          f"Rename or remove that folder, or run from another directory.")


_check_not_shadowed()


class TercompError(Exception):
    """Base class of all tercomp errors.

    `loc` is the user's source location (file:line) when the error was caused by a line
    of user code; `hint` says what to do instead.
    """

    def __init__(self, message: str, *, loc=None, hint: str | None = None):
        self.message = message
        self.loc = loc
        self.hint = hint
        text = message
        if loc is not None and str(loc):
            text = f"{loc}: {text}"
        if hint:
            text = f"{text}\n  hint: {hint}"
        super().__init__(text)


class TraceError(TercompError):
    """A problem found while tracing user code (shapes, dtypes, control flow)."""


class ParseError(TercompError):
    """Malformed tern IR text; the message names line and column."""

    def __init__(self, message: str, *, loc=None, hint: str | None = None):
        if loc is not None and f"line {loc.line}" not in message:
            message = f"{message} (line {loc.line}, column {loc.col})"
        super().__init__(message, loc=loc, hint=hint)


class TypeSpecError(TercompError, ValueError):
    """A shape or dtype tercomp cannot represent: a dim outside 0..2**40, more than 2**48
    elements, an unsupported dtype. Also a ValueError, as NumPy's errors for bad shapes
    and dtypes are: the places that build types from what a user gave (tc.spec, argument
    checks, the IR parser, a compiled module's signature) catch ValueError to add where
    the bad shape or dtype came from, and so does user code written against NumPy."""


class VerifyError(TercompError):
    """The IR broke a rule of an op; the message names op, rule and location."""


class CompileError(TercompError):
    """IREE rejected the module; the message names the stage and IREE's diagnostics."""


class ConfigError(TercompError, ValueError):
    """An option, argument or configuration tercomp does not accept: an unknown name (a
    target, a pass, a kernel, a pooling mode), a number out of range, an object of the
    wrong kind (compile_lm given something that is not a BitNetLM), options that
    contradict each other, or a model configuration field that is missing, unknown or
    out of range (`tercomp.models.ConfigError` is this class). The message names the
    option, the value given and what is accepted. Also a ValueError, as Python's own
    errors for a bad argument value are."""


class InputError(TercompError):
    """Data given to tercomp does not match what it is given to: arguments of a compiled
    module against its signature, token ids against the vocabulary or the context, a
    state dict against a model's parameters, packed weights against their shape."""


class ModelFileError(TercompError):
    """A model file tercomp cannot read as a model: a GGUF file (`models.GGUFError`), a
    Hugging Face checkpoint's safetensors or config (`models.CheckpointError`), or a path
    with no model. The message names the file and the key or tensor."""


class ArtifactError(TercompError):
    """A saved artifact (a .tcm, a training checkpoint) is missing, truncated, tampered
    with or from another version."""


class UnsupportedError(TercompError):
    """Something tercomp, the target, the host CPU or the model does not have: an op with
    no gradient rule, a kernel or strategy a target cannot build, a CPU feature the host
    lacks, a model family a writer cannot write, a model with no tokenizer or chat
    template. The request is well formed; it cannot be done here."""


class MissingDependency(TercompError):
    """An optional package a feature needs is not installed (iree-base-compiler, gguf,
    mpi4py, the serving extra); the message says what to install. `tc.CompilerMissing`
    (a compiler-side name asked for without iree-base-compiler) is one."""


class DeviceUnavailable(TercompError):
    """The requested device is not present; the message names the drivers that are."""


class ExecutionError(TercompError, RuntimeError):
    """Running failed for a reason not in the call's arguments: the IREE runtime reported
    an error (out of device memory, a lost device), the NumPy reference of an op failed,
    another rank of a data-parallel job failed (its own error says why), or the call
    would break one already running (a generator called from its own on_token
    callback). Also a RuntimeError, as Python's errors for these are."""


class NumericsError(TercompError):
    """A NaN or Inf appeared: in a module compiled with check_numerics (the message names
    the first op that produced it and the user's source line), or in a training step's
    loss or gradient norm with on_nan="raise"."""


class InternalError(TercompError):
    """A bug in tercomp: one of its own invariants broke (a gradient rule gave the wrong
    type, a kernel template and its parameters disagree). Please report it with the
    message."""


def check_number(owner: str, name: str, value, lo=None, hi=None, lo_open=False, hi_open=False) -> float:
    """`value` as a float when it is a finite real number within [lo, hi] (an open end
    with lo_open / hi_open); else a ConfigError naming `owner` and `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ConfigError(f"{owner}: {name} must be a finite number, got {value!r} "
                          f"({type(value).__name__})",
                          hint=f"pass {name} as a Python float, e.g. {name}=0.9")
    bad_lo = lo is not None and (value <= lo if lo_open else value < lo)
    bad_hi = hi is not None and (value >= hi if hi_open else value > hi)
    if bad_lo or bad_hi:
        lb = "" if lo is None else f"{'(' if lo_open else '['}{lo}"
        hb = "" if hi is None else f"{hi}{')' if hi_open else ']'}"
        raise ConfigError(f"{owner}: {name} = {value} is out of range {lb or '(-inf'}, {hb or 'inf)'}")
    return float(value)
