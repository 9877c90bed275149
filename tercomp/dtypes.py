"""The dtype table (a leaf module: NumPy and tercomp.errors only, shared by the IR, codegen, the runtime and
the CLI): tern dtype names, their NumPy dtypes and MLIR element types, and the spellings
accepted for them.

>>> dtype_name("float32"), dtype_name(np.int8), numpy_dtype("i1").name
('f32', 'i8', 'bool')
"""
from __future__ import annotations

import numpy as np

from .errors import TypeSpecError

# dtype name -> (numpy dtype, MLIR element type)
DTYPES = {
    "f64": (np.float64, "f64"),
    "f32": (np.float32, "f32"),
    "f16": (np.float16, "f16"),
    "i64": (np.int64, "i64"),
    "i32": (np.int32, "i32"),
    "i16": (np.int16, "i16"),
    "i8": (np.int8, "i8"),
    "i1": (np.bool_, "i1"),
}
_FROM_NUMPY = {np.dtype(v[0]).name: k for k, v in DTYPES.items()}
#: NumPy names -> tern names (what users and iree-run-module style inputs write)
ALIASES = {"float64": "f64", "float32": "f32", "float16": "f16", "int64": "i64",
           "int32": "i32", "int16": "i16", "int8": "i8", "bool": "i1"}


def dtype_name(dt) -> str:
    """Normalize 'float32', np.float32, np.dtype('float32') or 'f32' to 'f32'."""
    if isinstance(dt, str) and dt in DTYPES:
        return dt
    if isinstance(dt, str) and dt in ALIASES:
        return ALIASES[dt]
    try:
        return _FROM_NUMPY[np.dtype(dt).name]
    except (TypeError, KeyError):
        raise TypeSpecError(f"unsupported dtype {dt!r}; supported: {sorted(DTYPES)}") from None


def numpy_dtype(name: str) -> np.dtype:
    return np.dtype(DTYPES[name][0])


def mlir_element(name: str) -> str:
    """The MLIR element type spelling of a tern dtype name ('f32' -> 'f32', 'i1' -> 'i1')."""
    return DTYPES[name][1]
