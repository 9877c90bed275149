"""Every error tercomp raises derives from TercompError.

Errors say what was wrong, where in the user's code (a SourceLoc when one is known) and
what to do about it.
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


class InputError(TercompError):
    """Arguments given to a compiled module do not match its signature."""


class ArtifactError(TercompError):
    """A saved artifact is missing, truncated, tampered with or from another version."""


class DeviceUnavailable(TercompError):
    """The requested device is not present; the message names the drivers that are."""


class NumericsError(TercompError):
    """A NaN or Inf appeared in a module compiled with check_numerics; the message names
    the first op that produced it and the user's source line."""


def check_number(owner: str, name: str, value, lo=None, hi=None, lo_open=False, hi_open=False) -> float:
    """`value` as a float when it is a finite real number within [lo, hi] (an open end
    with lo_open / hi_open); else a TercompError naming `owner` and `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TercompError(f"{owner}: {name} must be a finite number, got {value!r} "
                           f"({type(value).__name__})",
                           hint=f"pass {name} as a Python float, e.g. {name}=0.9")
    bad_lo = lo is not None and (value <= lo if lo_open else value < lo)
    bad_hi = hi is not None and (value >= hi if hi_open else value > hi)
    if bad_lo or bad_hi:
        lb = "" if lo is None else f"{'(' if lo_open else '['}{lo}"
        hb = "" if hi is None else f"{hi}{')' if hi_open else ']'}"
        raise TercompError(f"{owner}: {name} = {value} is out of range {lb or '(-inf'}, {hb or 'inf)'}")
    return float(value)
