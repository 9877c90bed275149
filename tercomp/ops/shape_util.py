"""Helpers shared by the shape-changing ops: symbolic dims inside attributes and
NumPy references (`dim_to_attr`, `attr_to_dim`, `bind_symbols`), axis normalization,
and the MLIR pieces of reshapes and slices.

A symbolic dim inside an attribute (reshape's `shape`, split's `sizes`) is stored as its
string ("B", "B + C") and read back with `attr_to_dim`. A NumPy reference only sees
concrete arrays, so where a symbolic dim of an attribute cannot be deduced from the
operands (broadcast_to ["B", 4] from [1, 4]) it is looked up in `bind_symbols`, which
the interpreter sets from the concrete shapes of the graph inputs:

>>> with bind_symbols({"B": 8}):                                    # doctest: +SKIP
...     get("broadcast_to").reference([np.ones((1, 4))], {"shape": ["B", 4]})
"""
from __future__ import annotations

import contextlib
import contextvars

import numpy as np
import sympy

from iree.compiler import ir
from iree.compiler.dialects import flow, tensor, util

from ..codegen.builders import tensor_type
from ..errors import TercompError, TraceError
from ..ir import TensorType, as_dim, is_static
from ..ir.types import is_int

# `stop` of a slice that runs to the end of its axis. A symbolic axis can only be taken
# whole: start 0, step 1, and stop SLICE_END or the dim itself as a string ("B").
SLICE_END = 2 ** 63 - 1


# -- symbolic dims in attributes and references ------------------------------------------
def dim_to_attr(d):
    """A dim as an attribute value: ints stay ints, symbolic dims become strings."""
    return int(d) if is_static(d) else str(d)


def attr_to_dim(a):
    """Inverse of dim_to_attr: 'B' -> Symbol B, 'B + C' -> B + C, 32 -> 32. Text is read by
    the dim grammar (tercomp.dimexpr), never evaluated as code."""
    if isinstance(a, bool) or not isinstance(a, (int, str, np.integer)):
        raise TraceError(f"a dimension attribute must be an int or a name, got {a!r}")
    if not isinstance(a, str):
        return int(a)
    try:
        return as_dim(a)
    except TercompError as e:
        raise TraceError(f"cannot read the dimension {a!r}: {e.message}",
                         hint="write symbolic dims as names or sums/products of names") from None


def sym(d):
    """A dim as a sympy expression (ints become sympy Integers)."""
    return sympy.Integer(d) if isinstance(d, (int, np.integer)) else d


def fmt_shape(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def same_dim(a, b) -> bool:
    if is_static(a) and is_static(b):
        return a == b
    return as_dim(sym(a) - sym(b)) == 0


def prod(dims):
    p = sympy.Integer(1)
    for d in dims:
        p = p * d
    return as_dim(p)


_BINDINGS: contextvars.ContextVar = contextvars.ContextVar("tercomp_symbol_bindings", default={})


@contextlib.contextmanager
def bind_symbols(bindings: dict):
    """Give the NumPy references the values of symbolic dims ({'B': 8} or {Symbol: 8}).

    >>> with bind_symbols({"B": 2}):
    ...     concrete_dim(as_dim("B") * 3)
    6
    """
    norm = {(as_dim(k) if isinstance(k, str) else k): int(v) for k, v in bindings.items()}
    token = _BINDINGS.set({**_BINDINGS.get(), **norm})
    try:
        yield
    finally:
        _BINDINGS.reset(token)


def concrete_dim(d):
    """The int value of a dim under the current bind_symbols, or None if unbound."""
    if is_static(d):
        return int(d)
    v = sym(d).subs(_BINDINGS.get())
    return int(v) if v.is_Integer else None


def _unbound(opname, d):
    return TraceError(f"{opname}: the NumPy reference needs the value of the symbolic dim {d}",
                      hint="evaluate inside tercomp.ops.shape.bind_symbols({name: value}) "
                           "with the concrete sizes of the graph's inputs")


def _norm_axis(axis, rank, opname, shape):
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool) or not -rank <= axis < rank:
        raise TraceError(f"{opname}: axis {axis} is out of range for shape {fmt_shape(shape)} (rank {rank})",
                         hint=f"use an axis in [{-rank}, {rank - 1}]")
    return int(axis) % rank


def norm_axes(axes, rank, opname, shape):
    """Normalize a list of axes (None: all) to sorted non-negative ints, no repeats."""
    if axes is None:
        return list(range(rank))
    out = [_norm_axis(a, rank, opname, shape) for a in axes]
    if len(set(out)) != len(out):
        raise TraceError(f"{opname}: repeated axis in {list(axes)} for shape {fmt_shape(shape)}")
    return sorted(out)


# -- MLIR helpers shared by the shape-changing lowerings ---------------------------------
def _reassociation(long, short):
    """Group the dims of `long` into len(short) contiguous runs whose products are the
    dims of `short` (trailing 1s join the last run); None when greedy grouping fails."""
    if not short:
        return [] if all(d == 1 for d in long) else None
    groups, i = [], 0
    for d in short:
        group, p = [], sympy.Integer(1)
        while i < len(long):
            group.append(i)
            p = p * long[i]
            i += 1
            if same_dim(p, d):
                break
        if not group or not same_dim(p, d):
            return None
        groups.append(group)
    while i < len(long):
        if long[i] != 1:
            return None
        groups[-1].append(i)
        i += 1
    return groups


def reshape_value(ctx, v, src: TensorType, dst: TensorType):
    """Emit a reshape of `v` from src to dst (same element count) as
    tensor.collapse_shape / tensor.expand_shape, which IREE folds into neighbours."""
    if len(src.shape) == len(dst.shape) and all(same_dim(a, b) for a, b in zip(src.shape, dst.shape)):
        return v
    if len(dst.shape) < len(src.shape):
        groups = _reassociation(src.shape, dst.shape)
        if groups is not None:
            return tensor.CollapseShapeOp(tensor_type(dst), v, groups).result
    elif len(dst.shape) > len(src.shape):
        groups = _reassociation(dst.shape, src.shape)
        if groups is not None:
            return _expand(ctx, v, dst, groups)
    # No contiguous grouping (e.g. [4, 6] -> [8, 3]): go through one flat dim.
    flat = TensorType((src.numel(),), src.dtype)
    if src.rank != 1:
        v = tensor.CollapseShapeOp(tensor_type(flat), v, [list(range(src.rank))]).result
    return v if dst.rank == 1 else _expand(ctx, v, dst, [list(range(dst.rank))])


def _expand(ctx, v, dst: TensorType, groups):
    dyn = ir.ShapedType.get_dynamic_size()
    static = [d if is_static(d) else dyn for d in dst.shape]
    sizes = [ctx.dim(d) for d in dst.shape if not is_static(d)]
    return tensor.ExpandShapeOp(tensor_type(dst), v, groups, sizes, static).result


def _static_or_value(ctx, d):
    """(static int or kDynamic, list of the dynamic index values) for a slice operand:
    a static dim, a symbolic one, or an `index` value."""
    if isinstance(d, ir.Value):
        return ir.ShapedType.get_dynamic_size(), [d]
    if is_static(d):
        return d, []
    return ir.ShapedType.get_dynamic_size(), [ctx.dim(d)]


def _slice_parts(ctx, offsets, sizes, strides):
    parts = [[], [], [], [], [], []]
    for k, vals in enumerate((offsets, sizes, strides)):
        for d in vals:
            s, dyn = _static_or_value(ctx, d)
            parts[k].append(s)
            parts[k + 3].extend(dyn)
    static_off, static_size, static_stride, dyn_off, dyn_size, dyn_stride = parts
    return dyn_off, dyn_size, dyn_stride, static_off, static_size, static_stride


def check_integer_ids(t: TensorType, opname: str, what: str = "indices"):
    """Class ids and gather indices must be i32 or i64 (not bool, not float)."""
    if not is_int(t.dtype) or t.dtype == "i1":
        raise TraceError(f"{opname}: {what} must be integers (i32 or i64), got {t.dtype}",
                         hint=f"cast the {what} with x.astype('int32')")


def fence(ctx, v, t: TensorType):
    """`v` (of type t, a TensorType) behind `util.optimization_barrier`, its dynamic dims re-tied: a
    value IREE does not fuse into its consumer's dispatch."""
    (b,) = util.OptimizationBarrierOp([v.type], [v]).results
    dims = ctx.dyn_sizes(t)
    return flow.TensorTieShapeOp(b, dims).result if dims else b
