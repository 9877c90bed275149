"""Shape ops: reshape, transpose, broadcast_to, expand_dims, squeeze, concatenate/split,
slice/unslice, take/scatter_add, size; and `unbroadcast`, the transpose of broadcasting.

Linear ops come in transpose pairs whose VJPs name each other: concatenate <-> split,
slice <-> unslice, take <-> scatter_add, broadcast_to <-> unbroadcast (sum),
expand_dims <-> squeeze.

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
import math
import re

import numpy as np
import sympy

from ..errors import TraceError
from ..ir import TensorType, as_dim, is_static
from ..ir.types import is_float, is_int
from .registry import OpDef, REQUIRED, register

# `stop` of a slice that runs to the end of its axis. A symbolic axis can only be taken
# whole: start 0, step 1, and stop SLICE_END or the dim itself as a string ("B").
SLICE_END = 2 ** 63 - 1


# -- symbolic dims in attributes and references ------------------------------------------
def dim_to_attr(d):
    """A dim as an attribute value: ints stay ints, symbolic dims become strings."""
    return int(d) if is_static(d) else str(d)


def attr_to_dim(a):
    """Inverse of dim_to_attr: 'B' -> Symbol B, 'B + C' -> B + C, 32 -> 32."""
    if isinstance(a, bool) or not isinstance(a, (int, str, np.integer)):
        raise TraceError(f"a dimension attribute must be an int or a name, got {a!r}")
    if not isinstance(a, str):
        return int(a)
    if a.isidentifier():
        return as_dim(a)
    names = {n: as_dim(n) for n in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", a)}
    try:
        return as_dim(sympy.parse_expr(a, local_dict=names))
    except Exception:
        raise TraceError(f"cannot read the dimension {a!r}",
                         hint="write symbolic dims as names or sums/products of names") from None


def fmt_shape(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def same_dim(a, b) -> bool:
    if is_static(a) and is_static(b):
        return a == b
    return sympy.simplify(sympy.sympify(a) - sympy.sympify(b)) == 0


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
    v = sympy.sympify(d).subs(_BINDINGS.get())
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
    from iree.compiler.dialects import tensor
    from ..codegen.builders import tensor_type
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
    from iree.compiler import ir
    from iree.compiler.dialects import tensor
    from ..codegen.builders import tensor_type
    dyn = ir.ShapedType.get_dynamic_size()
    static = [d if is_static(d) else dyn for d in dst.shape]
    sizes = [ctx.dim(d) for d in dst.shape if not is_static(d)]
    return tensor.ExpandShapeOp(tensor_type(dst), v, groups, sizes, static).result


def _static_or_value(ctx, d):
    """(static int or kDynamic, list of the dynamic index values) for a slice operand."""
    from iree.compiler import ir
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


# -- reshape --------------------------------------------------------------------------
def _reshape_infer(types, a):
    (t,) = types
    dims = [attr_to_dim(d) for d in a["shape"]]
    shown = f"cannot reshape {fmt_shape(t.shape)} to {fmt_shape(dims)}"
    if sum(1 for d in dims if d == -1) > 1:
        raise TraceError(f"reshape: {shown}: only one dim may be -1")
    if any(is_static(d) and d < -1 for d in dims):
        raise TraceError(f"reshape: {shown}: negative dim")
    known = prod([d for d in dims if d != -1])
    total = t.numel()
    if -1 in dims:
        if known == 0:
            raise TraceError(f"reshape: {shown}: -1 is ambiguous next to a 0 dim")
        rest = sympy.cancel(sympy.sympify(total) / known)
        if sympy.fraction(rest)[1] != 1:
            raise TraceError(f"reshape: {shown}: {total} elements do not divide into {known}",
                             hint="the product of the new shape must equal the old one")
        dims = [as_dim(rest) if d == -1 else d for d in dims]
    elif not same_dim(known, total):
        raise TraceError(f"reshape: {shown}: {total} elements vs {known}",
                         hint="the product of the new shape must equal the old one")
    return [t.with_shape(dims)]


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
               vjp=_reshape_vjp, doc="NumPy reshape; one dim may be -1"))


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
    from ..codegen.builders import PARALLEL, affine_map
    out = op.results[0].type
    perm = list(op.attrs["perm"])
    r = out.rank
    in_map = affine_map(r, [perm.index(i) for i in range(r)])
    out_map = affine_map(r, list(range(r)))
    return [ctx.generic([xs[0]], [in_map], out, out_map, [PARALLEL] * r, lambda x, acc: x)]


def _transpose_vjp(b, op, cts):
    inv = list(np.argsort(op.attrs["perm"]))
    return [b.transpose(cts[0], perm=[int(p) for p in inv])]


register(OpDef("transpose", "shape", _transpose_infer,
               lambda xs, a: [np.transpose(xs[0], a["perm"]).copy()],
               attrs={"perm": REQUIRED}, lower=_transpose_lower, vjp=_transpose_vjp))


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
    from ..codegen.builders import broadcast_map, PARALLEL
    from iree.compiler import ir
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
               lower=_reshape_lower, vjp=_squeeze_vjp, doc="remove size-1 axes (default: all of them)"))


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
    total = sum((sympy.sympify(t.shape[ax]) for t in types), sympy.Integer(0))
    return [t0.with_shape(t0.shape[:ax] + (as_dim(total),) + t0.shape[ax + 1:])]


def _concat_lower(ctx, op, xs):
    from iree.compiler.dialects import tensor
    from ..codegen.builders import tensor_type
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
    if not sizes or not same_dim(sum((sympy.sympify(s) for s in sizes), sympy.Integer(0)), t.shape[ax]):
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
    from iree.compiler.dialects import tensor
    from ..codegen.builders import tensor_type
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
    from iree.compiler.dialects import tensor
    from ..codegen.builders import tensor_type
    dims = _slice_dims(op.operands[0].type.shape, op.attrs, "slice")
    parts = _slice_parts(ctx, *zip(*dims)) if dims else ([], [], [], [], [], [])
    return [tensor.ExtractSliceOp(tensor_type(op.results[0].type), xs[0], *parts).result]


def _slice_vjp(b, op, cts):
    x = op.operands[0]
    return [b.unslice(cts[0], shape=[dim_to_attr(d) for d in x.shape], **op.attrs)]


_SLICE_ATTRS = {"starts": REQUIRED, "stops": REQUIRED, "steps": REQUIRED}
register(OpDef("slice", "shape", _slice_infer, lambda xs, a: [xs[0][_slice_index(a)].copy()],
               attrs=_SLICE_ATTRS, lower=_slice_lower, vjp=_slice_vjp,
               doc=f"x[start:stop:step] per axis; stop {SLICE_END} means to the end"))


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
    from iree.compiler.dialects import tensor
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
    if not is_int(t.dtype) or t.dtype == "i1":
        raise TraceError(f"{opname}: indices must be integers (i32 or i64), got {t.dtype}",
                         hint="cast the indices with x.astype('int32')")


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
    from iree.compiler import ir
    from iree.compiler.dialects import arith
    from ..codegen.builders import index_const
    i = arith.IndexCastOp(ir.IndexType.get(), idx_scalar).result
    zero, one = index_const(0), index_const(1)
    neg = arith.CmpIOp(arith.CmpIPredicate.slt, i, zero).result
    i = arith.SelectOp(neg, arith.AddIOp(i, n).result, i).result
    i = arith.MaxSIOp(i, zero).result
    return arith.MinSIOp(i, arith.SubIOp(n, one).result).result


def _take_lower(ctx, op, xs):
    from iree.compiler import ir
    from iree.compiler.dialects import linalg, tensor
    from ..codegen.builders import affine_map, PARALLEL
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
    from iree.compiler.dialects import arith, linalg
    from ..codegen.builders import affine_map, scalar_const, PARALLEL, REDUCTION
    g_t, idx_t = op.operands[0].type, op.operands[1].type
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
    from iree.compiler import ir
    from iree.compiler.dialects import arith, tensor
    from ..codegen.builders import elem_type, index_const, tensor_type
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
