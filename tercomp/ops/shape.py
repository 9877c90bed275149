"""Shape ops: reshape, transpose, broadcast_to, expand_dims, squeeze, concatenate/split,
size; and `unbroadcast`, the transpose of broadcasting. (Slicing and gathers live in
index.py; helpers for symbolic dims in shape_util.py.)

Linear ops come in transpose pairs whose VJPs name each other: concatenate <-> split,
broadcast_to <-> unbroadcast (sum), expand_dims <-> squeeze.
"""
from __future__ import annotations

import math

import numpy as np
import sympy

from iree.compiler import ir
from iree.compiler.dialects import arith, tensor

from ..codegen.builders import PARALLEL, affine_map, broadcast_map, elem_type, index_const, tensor_type
from ..errors import TraceError
from ..ir import TensorType, as_dim, is_static
from ..ir.types import is_float
from .registry import OpDef, REQUIRED, register
from .shape_util import (_norm_axis, _slice_parts, _unbound, attr_to_dim, concrete_dim, dim_to_attr, fence,
                         fmt_shape, norm_axes, prod, reshape_value, same_dim, sym)


# -- reshape --------------------------------------------------------------------------
def _reshape_infer(types, a):
    (t,) = types
    dims = [attr_to_dim(d) for d in a["shape"]]
    shown = f"cannot reshape {fmt_shape(t.shape)} to {fmt_shape(dims)}"
    if sum(1 for d in dims if d == -1) > 1:
        raise TraceError(f"reshape: {shown}: only one dim may be -1")
    if any(is_static(d) and d < -1 for d in dims):
        raise TraceError(f"reshape: {shown}: negative dim")
    if t.is_static and all(is_static(d) for d in dims):
        return [t.with_shape(_static_reshape(t.shape, dims, shown))]
    known = prod([d for d in dims if d != -1])
    total = t.numel()
    if -1 in dims:
        if known == 0:
            raise TraceError(f"reshape: {shown}: -1 is ambiguous next to a 0 dim")
        rest = sympy.cancel(sym(total) / known)
        if sympy.fraction(rest)[1] != 1:
            raise TraceError(f"reshape: {shown}: {total} elements do not divide into {known}",
                             hint="the product of the new shape must equal the old one")
        dims = [as_dim(rest) if d == -1 else d for d in dims]
    elif not same_dim(known, total):
        raise TraceError(f"reshape: {shown}: {total} elements vs {known}",
                         hint="the product of the new shape must equal the old one")
    return [t.with_shape(dims)]


def _static_reshape(shape, dims, shown) -> list:
    """The dims of a reshape between static shapes, in integers (sympy is for symbolic
    dims; a traced model reshapes hundreds of times)."""
    total = math.prod(int(d) for d in shape)
    known = math.prod(int(d) for d in dims if d != -1)
    if -1 in dims:
        if known == 0:
            raise TraceError(f"reshape: {shown}: -1 is ambiguous next to a 0 dim")
        if total % known:
            raise TraceError(f"reshape: {shown}: {total} elements do not divide into {known}",
                             hint="the product of the new shape must equal the old one")
        return [total // known if d == -1 else int(d) for d in dims]
    if known != total:
        raise TraceError(f"reshape: {shown}: {total} elements vs {known}",
                         hint="the product of the new shape must equal the old one")
    return [int(d) for d in dims]


def _reshape_ref(xs, a):
    dims = [attr_to_dim(d) for d in a["shape"]]
    shape = [-1 if d == -1 else concrete_dim(d) for d in dims]
    unknown = [i for i, d in enumerate(shape) if d is None or d == -1]
    if len(unknown) > 1:
        raise _unbound("reshape", dims[next(i for i in unknown if dims[i] != -1)])
    return [np.reshape(xs[0], [-1 if d is None else d for d in shape])]


def _reshape_vjp(b, op, cts):
    x = op.operands[0]
    return [b.reshape(cts[0], shape=[dim_to_attr(d) for d in x.shape])]


register(OpDef("reshape", "shape", _reshape_infer, _reshape_ref, attrs={"shape": REQUIRED},
               lower=lambda ctx, op, xs: [reshape_value(ctx, xs[0], op.operands[0].type, op.results[0].type)],
               vjp=_reshape_vjp, method="reshape", doc="NumPy reshape; one dim may be -1"))


# -- transpose --------------------------------------------------------------------------
def _check_perm(perm, t):
    if sorted(perm) != list(range(t.rank)):
        raise TraceError(f"transpose: {list(perm)} is not a permutation of the axes of {fmt_shape(t.shape)}",
                         hint=f"give each of 0..{t.rank - 1} exactly once")
    return list(perm)


def _transpose_infer(types, a):
    (t,) = types
    perm = _check_perm(a["perm"], t)
    return [t.with_shape([t.shape[p] for p in perm])]


def _transpose_lower(ctx, op, xs):
    # A generic, not linalg.transpose: that builder returns the op (not its value) and
    # leaves the region empty.
    out = op.results[0].type
    perm = list(op.attrs["perm"])
    r = out.rank
    in_map = affine_map(r, [perm.index(i) for i in range(r)])
    out_map = affine_map(r, list(range(r)))
    x = xs[0]
    if perm and perm[-1] != r - 1 and _matmul_result(op.operands[0]):
        x = fence(ctx, x, op.operands[0].type)
    return [ctx.generic([x], [in_map], out, out_map, [PARALLEL] * r, lambda x, acc: x)]


def _matmul_result(v) -> bool:
    """Is v a matmul's result (through reshapes)? A transpose that moves the last dim of
    one is kept out of the matmul's dispatch (reduce.fence): IREE 3.13 fuses it as the
    contraction's output map, a strided store for every output, and ran such matmuls
    3-7x slower than the matmul and the transpose apart (BitConv's input gradient before
    the col2im, a 32x1024x576 one: 942 ms against 129 + 212 ms; bench/RESULTS.md)."""
    while v.producer is not None and v.producer.opname == "reshape":
        v = v.producer.operands[0]
    return v.producer is not None and v.producer.opname == "matmul"


def _transpose_vjp(b, op, cts):
    inv = list(np.argsort(op.attrs["perm"]))
    return [b.transpose(cts[0], perm=[int(p) for p in inv])]


register(OpDef("transpose", "shape", _transpose_infer,
               lambda xs, a: [np.transpose(xs[0], a["perm"]).copy()],
               attrs={"perm": REQUIRED}, lower=_transpose_lower, vjp=_transpose_vjp, method="transpose"))


# -- broadcast_to and its transpose -----------------------------------------------------
def _broadcast_infer(types, a):
    (t,) = types
    dims = [attr_to_dim(d) for d in a["shape"]]
    off = len(dims) - t.rank
    ok = off >= 0 and all(d == 1 or same_dim(d, dims[off + i]) for i, d in enumerate(t.shape))
    if not ok:
        raise TraceError(f"broadcast_to: cannot broadcast {fmt_shape(t.shape)} to {fmt_shape(dims)}",
                         hint="each dim must match the target's trailing dim or be 1")
    return [t.with_shape(dims)]


def _broadcast_ref(xs, a):
    x = xs[0]
    dims = [attr_to_dim(d) for d in a["shape"]]
    off = len(dims) - x.ndim
    shape = []
    for i, d in enumerate(dims):
        c = concrete_dim(d)
        if c is None and i >= off and x.shape[i - off] != 1:
            c = x.shape[i - off]
        if c is None:
            raise _unbound("broadcast_to", d)
        shape.append(c)
    return [np.broadcast_to(x, shape).copy()]


def _broadcast_lower(ctx, op, xs):
    t, out = op.operands[0].type, op.results[0].type
    return [ctx.generic(xs, [broadcast_map(t, out)], out, ir.AffineMap.get_identity(out.rank),
                        [PARALLEL] * out.rank, lambda x, _acc: x)]


def unbroadcast(b, v, target_type: TensorType):
    """Sum `v` over the axes that broadcasting `target_type` to v's shape added or
    stretched, giving a value of target_type's shape (the VJP of NumPy broadcasting).
    Returns v itself when the shapes already match.

    >>> g = unbroadcast(b, cotangent_of_x_plus_bias, bias.type)   # doctest: +SKIP
    """
    shape, target = v.type.shape, target_type.shape
    off = len(shape) - len(target)
    if off < 0:
        raise TraceError(f"unbroadcast: {fmt_shape(shape)} is not a broadcast of {fmt_shape(target)}")
    if off == 0 and all(same_dim(a, c) for a, c in zip(shape, target)):
        return v
    if off:
        v = b.sum(v, axes=list(range(off)), keepdims=False)
    stretched = [i for i, d in enumerate(target) if d == 1 and shape[off + i] != 1]
    if stretched:
        v = b.sum(v, axes=stretched, keepdims=True)
    return v


register(OpDef("broadcast_to", "shape", _broadcast_infer, _broadcast_ref, attrs={"shape": REQUIRED},
               lower=_broadcast_lower, vjp=lambda b, op, cts: [unbroadcast(b, cts[0], op.operands[0].type)],
               doc="NumPy broadcast_to; symbolic target dims as strings"))


# -- expand_dims / squeeze ---------------------------------------------------------------
def _expand_axis(t, axis):
    r = t.rank + 1
    if isinstance(axis, bool) or not isinstance(axis, int) or not -r <= axis < r:
        raise TraceError(f"expand_dims: axis {axis} is out of range for shape {fmt_shape(t.shape)}",
                         hint=f"use an axis in [{-r}, {r - 1}]")
    return axis % r


def _expand_dims_infer(types, a):
    (t,) = types
    ax = _expand_axis(t, a["axis"])
    return [t.with_shape(t.shape[:ax] + (1,) + t.shape[ax:])]


def _reshape_lower(ctx, op, xs):
    return [reshape_value(ctx, xs[0], op.operands[0].type, op.results[0].type)]


register(OpDef("expand_dims", "shape", _expand_dims_infer,
               lambda xs, a: [np.expand_dims(xs[0], a["axis"])], attrs={"axis": REQUIRED},
               lower=_reshape_lower,
               vjp=lambda b, op, cts: [b.squeeze(cts[0], axes=[_expand_axis(op.operands[0].type, op.attrs["axis"])])]))


def _squeeze_axes(t, axes):
    if axes is None:
        return [i for i, d in enumerate(t.shape) if d == 1]
    axes = norm_axes(axes, t.rank, "squeeze", t.shape)
    for ax in axes:
        if t.shape[ax] != 1:
            raise TraceError(f"squeeze: axis {ax} of {fmt_shape(t.shape)} has size {t.shape[ax]}, not 1",
                             hint="only size-1 axes can be squeezed")
    return axes


def _squeeze_infer(types, a):
    (t,) = types
    axes = _squeeze_axes(t, a.get("axes"))
    return [t.with_shape([d for i, d in enumerate(t.shape) if i not in axes])]


def _squeeze_ref(xs, a):
    x = xs[0]
    axes = a.get("axes")
    return [np.squeeze(x, axis=None if axes is None else tuple(axes))]


def _squeeze_vjp(b, op, cts):
    g = cts[0]
    for ax in _squeeze_axes(op.operands[0].type, op.attrs.get("axes")):
        g = b.expand_dims(g, axis=ax)
    return [g]


register(OpDef("squeeze", "shape", _squeeze_infer, _squeeze_ref, attrs={"axes": None},
               lower=_reshape_lower, vjp=_squeeze_vjp, method="squeeze",
               doc="remove size-1 axes (default: all of them)"))


# -- concatenate / split ---------------------------------------------------------------
def _concat_infer(types, a):
    if not types:
        raise TraceError("concatenate needs at least one operand")
    t0 = types[0]
    shown = ", ".join(fmt_shape(t.shape) for t in types)
    if any(t.rank != t0.rank for t in types) or t0.rank == 0:
        raise TraceError(f"concatenate: operands {shown} must have the same rank (at least 1)")
    if len({t.dtype for t in types}) > 1:
        raise TraceError(f"concatenate: operands have different dtypes {sorted({t.dtype for t in types})}",
                         hint="cast them to one dtype first")
    ax = _norm_axis(a["axis"], t0.rank, "concatenate", t0.shape)
    for t in types[1:]:
        for i in range(t0.rank):
            if i != ax and not same_dim(t.shape[i], t0.shape[i]):
                raise TraceError(f"concatenate: shapes {shown} differ in dim {i}, not only in the "
                                 f"concatenation axis {ax}")
    total = sum((sym(t.shape[ax]) for t in types), sympy.Integer(0))
    return [t0.with_shape(t0.shape[:ax] + (as_dim(total),) + t0.shape[ax + 1:])]


def _concat_lower(ctx, op, xs):
    if len(xs) == 1:
        return [xs[0]]
    ax = op.attrs["axis"] % op.results[0].type.rank
    return [tensor.ConcatOp(tensor_type(op.results[0].type), ax, xs).result]


def _concat_vjp(b, op, cts):
    ax = op.attrs["axis"] % op.results[0].type.rank
    parts = b.split(cts[0], axis=ax, sizes=[dim_to_attr(v.shape[ax]) for v in op.operands])
    return list(parts) if isinstance(parts, tuple) else [parts]


register(OpDef("concatenate", "shape", _concat_infer,
               lambda xs, a: [np.concatenate(xs, axis=a["axis"])], num_operands=None,
               attrs={"axis": REQUIRED}, lower=_concat_lower, vjp=_concat_vjp))


def _split_infer(types, a):
    (t,) = types
    if t.rank == 0:
        raise TraceError("split: cannot split a rank-0 tensor")
    ax = _norm_axis(a["axis"], t.rank, "split", t.shape)
    sizes = [attr_to_dim(s) for s in a["sizes"]]
    if not sizes or not same_dim(sum((sym(s) for s in sizes), sympy.Integer(0)), t.shape[ax]):
        raise TraceError(f"split: sizes {fmt_shape(sizes)} do not add up to dim {ax} of {fmt_shape(t.shape)}")
    return [t.with_shape(t.shape[:ax] + (s,) + t.shape[ax + 1:]) for s in sizes]


def _split_ref(xs, a):
    x = xs[0]
    ax = a["axis"] % x.ndim
    sizes = [concrete_dim(attr_to_dim(s)) for s in a["sizes"]]
    missing = [i for i, s in enumerate(sizes) if s is None]
    if len(missing) > 1:
        raise _unbound("split", attr_to_dim(a["sizes"][missing[1]]))
    if missing:  # one unknown size is what the others leave over
        sizes[missing[0]] = x.shape[ax] - sum(s for s in sizes if s is not None)
    return [p.copy() for p in np.split(x, np.cumsum(sizes)[:-1], axis=ax)]


def _split_lower(ctx, op, xs):
    t = op.operands[0].type
    ax = op.attrs["axis"] % t.rank
    outs, offset = [], sympy.Integer(0)
    for r in op.results:
        offs = [0] * t.rank
        offs[ax] = as_dim(offset)
        parts = _slice_parts(ctx, offs, r.type.shape, [1] * t.rank)
        outs.append(tensor.ExtractSliceOp(tensor_type(r.type), xs[0], *parts).result)
        offset = offset + r.type.shape[ax]
    return outs


def zeros(b, t: TensorType):
    """A zero tensor of type t (symbolic dims allowed) as tern ops."""
    z = b.scalar(0, t.dtype)
    return z if t.rank == 0 else b.broadcast_to(z, shape=[dim_to_attr(d) for d in t.shape])


def _split_vjp(b, op, cts):
    parts = [g if g is not None else zeros(b, r.type) for g, r in zip(cts, op.results)]
    return [parts[0] if len(parts) == 1 else b.concatenate(*parts, axis=op.attrs["axis"])]


register(OpDef("split", "shape", _split_infer, _split_ref, attrs={"axis": REQUIRED, "sizes": REQUIRED},
               lower=_split_lower, vjp=_split_vjp,
               doc="the transpose of concatenate: consecutive pieces of the given sizes"))


# -- size ----------------------------------------------------------------------------------
def _size_dtype(t):
    return t.dtype if is_float(t.dtype) else "f32"


def _size_infer(types, a):
    (t,) = types
    norm_axes(a.get("axes"), t.rank, "size", t.shape)
    return [TensorType((), _size_dtype(t))]


def _size_ref(xs, a):
    x = xs[0]
    axes = range(x.ndim) if a.get("axes") is None else [ax % x.ndim for ax in a["axes"]]
    dt = x.dtype if x.dtype.kind == "f" else np.float32
    return [np.asarray(math.prod(x.shape[ax] for ax in axes), dtype=dt)]


def _size_lower(ctx, op, xs):
    t = op.operands[0].type
    n = index_const(1)
    for ax in norm_axes(op.attrs.get("axes"), t.rank, "size", t.shape):
        d = t.shape[ax]
        # A symbolic dim is read off this operand, so size works on any intermediate.
        dv = index_const(d) if is_static(d) else tensor.DimOp(xs[0], index_const(ax)).result
        n = arith.MulIOp(n, dv).result
    i64 = arith.IndexCastOp(ir.IntegerType.get_signless(64), n).result
    f = arith.SIToFPOp(elem_type(op.results[0].dtype), i64).result
    return [tensor.FromElementsOp(tensor_type(op.results[0].type), [f]).result]


register(OpDef("size", "shape", _size_infer, _size_ref, attrs={"axes": None}, lower=_size_lower,
               vjp=lambda b, op, cts: [None], nondiff_operands=(0,),
               doc="number of elements over `axes` (default all) as a rank-0 float"))
