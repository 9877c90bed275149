"""Tensor types of tern IR: a shape of ints or sympy expressions, and a dtype name.

A symbolic dim (`sympy.Symbol("B")`) lowers to a dynamic MLIR dim (`?`), so one
compiled module serves every value of B. Dims computed from symbols (B*2, after a
reshape or concatenate) stay sympy expressions.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Tuple, Union

import numpy as np
import sympy

from .. import dimexpr
from ..errors import TypeSpecError
from ..dtypes import DTYPES, dtype_name, numpy_dtype  # noqa: F401  (re-exported)

Dim = Union[int, sympy.Expr]

# Sizes past these overflow IREE's 64-bit byte offsets (a 2**62 dim crashed the compiler).
MAX_DIM = 1 << 40
MAX_ELEMENTS = 1 << 48

# the dtype table lives in the leaf module tercomp.dtypes (the runtime reads it too)


def is_float(name: str) -> bool:
    return name.startswith("f")


def is_int(name: str) -> bool:
    return name.startswith("i")


def as_dim(d) -> Dim:
    """An int stays an int; a name becomes a Symbol; other text ("2*B + 1") is read by the
    dim grammar of `tercomp.dimexpr` (never eval'd); a sympy integer becomes an int."""
    if isinstance(d, str):
        if d.isidentifier():
            return sympy.Symbol(d, integer=True, positive=True)
        return as_dim(dimexpr.fold(dimexpr.parse(d), as_dim, sympy.Integer, sympy.floor, sympy.ceiling))
    if isinstance(d, (int, np.integer)):
        return int(d)
    if isinstance(d, sympy.Expr):
        return _simplified(d)
    raise TypeSpecError(f"a dimension must be an int or a name (\"B\"), got {d!r}")


@functools.lru_cache(maxsize=8192)
def _simplified(e: sympy.Expr) -> Dim:
    """sympy.simplify of a dim expression, memoized: a model's shapes repeat the same few
    expressions thousands of times (an LM's layers), and simplify costs ~1 ms each."""
    e = sympy.simplify(e)
    return int(e) if e.is_Integer else e


def is_static(d: Dim) -> bool:
    return isinstance(d, int)


@dataclass(frozen=True)
class TensorType:
    shape: Tuple[Dim, ...]
    dtype: str

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(as_dim(d) for d in self.shape))
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        for k, d in enumerate(self.shape):
            if is_static(d) and not 0 <= d <= MAX_DIM:
                raise TypeSpecError(f"dim {k} of shape ({', '.join(map(str, self.shape))}) is {d}: a dim "
                                 f"must be from 0 to 2**40 (a symbolic size is a name, e.g. \"B\")")
        if math.prod(d for d in self.shape if is_static(d)) > MAX_ELEMENTS:
            raise TypeSpecError(f"shape ({', '.join(map(str, self.shape))}) has more than 2**48 elements")

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_static(self) -> bool:
        return all(is_static(d) for d in self.shape)

    @property
    def symbols(self) -> set:
        out = set()
        for d in self.shape:
            if not is_static(d):
                out |= d.free_symbols
        return out

    def numel(self) -> Dim:
        n = sympy.Integer(1)
        for d in self.shape:
            n = n * d
        return as_dim(n)

    def mlir(self) -> str:
        """MLIR spelling: symbolic dims print as '?'."""
        dims = "".join(f"{d if is_static(d) else '?'}x" for d in self.shape)
        return f"tensor<{dims}{DTYPES[self.dtype][1]}>"

    def with_shape(self, shape) -> "TensorType":
        return TensorType(tuple(shape), self.dtype)

    def with_dtype(self, dtype) -> "TensorType":
        return TensorType(self.shape, dtype)

    def __str__(self):
        dims = ", ".join(str(d) for d in self.shape)
        return f"[{dims}]{self.dtype}"


def concrete_shape(shape, bindings: dict) -> tuple:
    """Evaluate a symbolic shape given {Symbol: int}."""
    out = []
    for d in shape:
        out.append(d if is_static(d) else int(d.subs(bindings)))
    return tuple(out)
