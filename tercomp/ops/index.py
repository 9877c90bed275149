"""Indexing ops: slice/unslice (static slices; unslice is slice's transpose, zeros
with the slice inserted) and take/scatter_add (gather of integer indices along an axis,
e.g. an embedding lookup, and its transpose)."""
from __future__ import annotations

import numpy as np

from iree.compiler import ir
from iree.compiler.dialects import arith, linalg, tensor, util

from ..codegen.builders import PARALLEL, REDUCTION, affine_map, index_const, scalar_const, tensor_type
from ..errors import TraceError
from ..ir import is_static
from ..ir.types import is_float
from .registry import OpDef, REQUIRED, register
from .shape_util import (SLICE_END, check_integer_ids, _norm_axis, _slice_parts, _unbound, attr_to_dim, concrete_dim,
                         dim_to_attr, fmt_shape, same_dim)


# -- slice / unslice ---------------------------------------------------------------------
def _slice_dims(shape, a, opname):
    """Per axis (start, size, step) of the slice, normalized like Python slicing."""
    starts, stops, steps = a["starts"], a["stops"], a["steps"]
    if not len(starts) == len(stops) == len(steps) == len(shape):
        raise TraceError(f"{opname}: starts/stops/steps need one entry per axis of {fmt_shape(shape)}, "
                         f"got {len(starts)}/{len(stops)}/{len(steps)}")
    out = []
    for ax, (d, s, e, st) in enumerate(zip(shape, starts, stops, steps)):
        if not isinstance(st, int) or st <= 0:
            raise TraceError(f"{opname}: step {st} on axis {ax} of {fmt_shape(shape)} must be a positive int")
        if is_static(d):
            s0, e0, _ = slice(s, e, st).indices(d)
            out.append((s0, len(range(s0, e0, st)), st))
        elif s == 0 and st == 1 and (e == SLICE_END or (isinstance(e, str) and same_dim(attr_to_dim(e), d))):
            out.append((0, d, 1))
        else:
            raise TraceError(f"{opname}: axis {ax} of {fmt_shape(shape)} has the symbolic size {d} "
                             f"and can only be taken whole, not as {s}:{e}:{st}",
                             hint="slice a symbolic axis only as x[:]")
    return out


def _slice_infer(types, a):
    (t,) = types
    return [t.with_shape([n for _, n, _ in _slice_dims(t.shape, a, "slice")])]


def _slice_index(a):
    # A symbolic axis (its stop is SLICE_END or the dim's name) is taken whole.
    return tuple(slice(s, None if isinstance(e, str) else e, st)
                 for s, e, st in zip(a["starts"], a["stops"], a["steps"]))


def _slice_lower(ctx, op, xs):
    dims = _slice_dims(op.operands[0].type.shape, op.attrs, "slice")
    if op.attrs.get("runtime_offsets"):
        # IREE folds a slice into the code that reads it; a start it cannot see
        # (util.optimization_barrier) is a push constant there, so the same code reading
        # at other starts (each layer's weights in one packed vector) is one executable
        # (an axis taken whole keeps its static start)
        shape = op.operands[0].type.shape
        dims = [(s, n, st) if (s == 0 and n == d) else
                (util.optimization_barrier([ir.IndexType.get()], [index_const(s)]), n, st)
                for (s, n, st), d in zip(dims, shape)]
    parts = _slice_parts(ctx, *zip(*dims)) if dims else ([], [], [], [], [], [])
    return [tensor.ExtractSliceOp(tensor_type(op.results[0].type), xs[0], *parts).result]


def _slice_vjp(b, op, cts):
    x = op.operands[0]
    return [b.unslice(cts[0], shape=[dim_to_attr(d) for d in x.shape],
                      **{k: op.attrs[k] for k in _SLICE_ATTRS})]


_SLICE_ATTRS = {"starts": REQUIRED, "stops": REQUIRED, "steps": REQUIRED}
register(OpDef("slice", "shape", _slice_infer, lambda xs, a: [xs[0][_slice_index(a)].copy()],
               attrs={**_SLICE_ATTRS, "runtime_offsets": False}, lower=_slice_lower,
               vjp=_slice_vjp,
               doc=f"x[start:stop:step] per axis; stop {SLICE_END} means to the end "
                   "(runtime_offsets: the starts are run-time values in the compiled code, "
                   "which slices at other starts then share)"))


def _unslice_infer(types, a):
    (t,) = types
    shape = [attr_to_dim(d) for d in a["shape"]]
    sliced = [n for _, n, _ in _slice_dims(shape, a, "unslice")]
    if len(sliced) != t.rank or not all(same_dim(p, q) for p, q in zip(sliced, t.shape)):
        raise TraceError(f"unslice: {fmt_shape(t.shape)} is not the shape of that slice of "
                         f"{fmt_shape(shape)} (which is {fmt_shape(sliced)})")
    return [t.with_shape(shape)]


def _unslice_ref(xs, a):
    g = xs[0]
    shape = []
    for ax, d in enumerate(attr_to_dim(d) for d in a["shape"]):
        shape.append(d if is_static(d) else g.shape[ax])  # symbolic axes are taken whole
    out = np.zeros(shape, g.dtype)
    out[_slice_index(a)] = g
    return [out]


def _unslice_lower(ctx, op, xs):
    out = op.results[0].type
    dims = _slice_dims(out.shape, op.attrs, "unslice")
    parts = _slice_parts(ctx, *zip(*dims)) if dims else ([], [], [], [], [], [])
    return [tensor.InsertSliceOp(xs[0], ctx.fill(out, 0), *parts).result]


register(OpDef("unslice", "shape", _unslice_infer, _unslice_ref,
               attrs={"shape": REQUIRED, **_SLICE_ATTRS}, lower=_unslice_lower,
               vjp=lambda b, op, cts: [b.slice(cts[0], **{k: op.attrs[k] for k in _SLICE_ATTRS})],
               doc="the transpose of slice: zeros of `shape` with the operand at the sliced positions"))


# -- take / scatter_add --------------------------------------------------------------------
def _check_indices(t, opname):
    check_integer_ids(t, opname, "indices")


def _take_infer(types, a):
    x, idx = types
    _check_indices(idx, "take")
    if x.rank == 0:
        raise TraceError("take: cannot index a rank-0 tensor")
    ax = _norm_axis(a["axis"], x.rank, "take", x.shape)
    return [x.with_shape(x.shape[:ax] + idx.shape + x.shape[ax + 1:])]


def _clamp_indices(idx, n):
    """Negative indices count from the end, then clamp into [0, n - 1] (never out of bounds)."""
    idx = idx.astype(np.int64)
    idx = np.where(idx < 0, idx + n, idx)
    return np.clip(idx, 0, max(n - 1, 0))


def _take_ref(xs, a):
    x, idx = xs
    ax = a["axis"] % x.ndim
    return [np.take(x, _clamp_indices(idx, x.shape[ax]), axis=ax)]


def _clamp_index_value(idx_scalar, n):
    """MLIR twin of _clamp_indices on one index scalar (n: an index value)."""
    i = arith.IndexCastOp(ir.IndexType.get(), idx_scalar).result
    zero, one = index_const(0), index_const(1)
    neg = arith.CmpIOp(arith.CmpIPredicate.slt, i, zero).result
    i = arith.SelectOp(neg, arith.AddIOp(i, n).result, i).result
    i = arith.MaxSIOp(i, zero).result
    return arith.MinSIOp(i, arith.SubIOp(n, one).result).result


def _take_lower(ctx, op, xs):
    x_t, idx_t = op.operands[0].type, op.operands[1].type
    out = op.results[0].type
    ax, k = op.attrs["axis"] % x_t.rank, idx_t.rank
    n = ctx.dim(x_t.shape[ax])
    x = xs[0]

    def body(idx_scalar, _acc):
        pos = [linalg.IndexOp(d).result for d in range(out.rank)]
        i = _clamp_index_value(idx_scalar, n)
        return tensor.ExtractOp(x, pos[:ax] + [i] + pos[ax + k:]).result

    idx_map = affine_map(out.rank, list(range(ax, ax + k)))
    return [ctx.generic([xs[1]], [idx_map], out, ir.AffineMap.get_identity(out.rank),
                        [PARALLEL] * out.rank, body)]


def _take_vjp(b, op, cts):
    x, idx = op.operands
    ax = op.attrs["axis"] % x.type.rank
    return [b.scatter_add(cts[0], idx, axis=ax, size=dim_to_attr(x.shape[ax])), None]


register(OpDef("take", "shape", _take_infer, _take_ref, num_operands=2, attrs={"axis": 0},
               lower=_take_lower, vjp=_take_vjp, nondiff_operands=(1,),
               doc="gather (embedding lookup) along an axis; indices wrap once if negative, then clamp"))


def _scatter_infer(types, a):
    g, idx = types
    _check_indices(idx, "scatter_add")
    k = idx.rank
    ax = a["axis"]
    if not isinstance(ax, int) or not 0 <= ax <= g.rank - k or not all(
            same_dim(p, q) for p, q in zip(g.shape[ax:ax + k], idx.shape)):
        raise TraceError(f"scatter_add: the indices {fmt_shape(idx.shape)} must match dims {ax}.. "
                         f"of the updates {fmt_shape(g.shape)}")
    size = attr_to_dim(a["size"])
    return [g.with_shape(g.shape[:ax] + (size,) + g.shape[ax + k:])]


def _scatter_ref(xs, a):
    g, idx = xs
    ax, k = a["axis"], idx.ndim
    size = concrete_dim(attr_to_dim(a["size"]))
    if size is None:
        raise _unbound("scatter_add", attr_to_dim(a["size"]))
    out = np.zeros(g.shape[:ax] + (size,) + g.shape[ax + k:], g.dtype)
    flat = _clamp_indices(idx, size).reshape(-1)
    updates = g.reshape(g.shape[:ax] + (flat.size,) + g.shape[ax + k:])
    np.add.at(out, (slice(None),) * ax + (flat,), updates)
    return [out]


def _scatter_lower(ctx, op, xs):
    # out[pre, v, post] = sum_i (clamp(idx[i]) == v) * g[pre, i, post]: a reduction over
    # the index dims, so every output element is written by one thread (no atomics).
    idx_t = op.operands[1].type
    out = op.results[0].type
    ax, k = op.attrs["axis"], idx_t.rank
    n_out = out.rank
    n = ctx.dim(out.shape[ax])
    idx_dims = list(range(n_out, n_out + k))
    g_map = affine_map(n_out + k, list(range(ax)) + idx_dims + list(range(ax + 1, n_out)))
    i_map = affine_map(n_out + k, idx_dims)
    o_map = affine_map(n_out + k, list(range(n_out)))
    fl = is_float(out.dtype)

    def body(g, idx_scalar, acc):
        hit = arith.CmpIOp(arith.CmpIPredicate.eq, _clamp_index_value(idx_scalar, n),
                           linalg.IndexOp(ax).result).result
        term = arith.SelectOp(hit, g, scalar_const(0, out.dtype)).result
        return arith.AddFOp(acc, term).result if fl else arith.AddIOp(acc, term).result

    return [ctx.generic(xs, [g_map, i_map], out, o_map, [PARALLEL] * n_out + [REDUCTION] * k,
                        body, init=ctx.fill(out, 0))]


register(OpDef("scatter_add", "shape", _scatter_infer, _scatter_ref, num_operands=2,
               attrs={"axis": 0, "size": REQUIRED}, lower=_scatter_lower,
               vjp=lambda b, op, cts: [b.take(cts[0], op.operands[1], axis=op.attrs["axis"]), None],
               nondiff_operands=(1,),
               doc="the transpose of take: out[..., v, ...] = sum of updates whose index is v"))
