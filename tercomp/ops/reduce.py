"""Reductions: sum, max, min (over `axes`, default all, with `keepdims`), argmax, and
mean (a composite: sum / size, with its own VJP).

Each lowers to a linalg.generic with reduction iterators over a filled init (0, -inf,
+inf), one per contiguous run of reduced axes; keepdims is a tensor.expand_shape of the
result, so output maps stay projected permutations. The VJP of max/min gives tied
extrema equal shares of the cotangent (g * mask / count), as torch.amax does.
"""
from __future__ import annotations

import numpy as np

from iree.compiler import ir
from iree.compiler.dialects import arith, linalg

from ..codegen.builders import PARALLEL, REDUCTION, affine_map, elem_type, iterator_attr, maps_attr, tensor_type
from ..errors import TraceError
from ..ir import TensorType, numpy_dtype
from ..ir.types import is_float
from .registry import OpDef, REQUIRED, register
from .shape_util import dim_to_attr, fence, fmt_shape, norm_axes, reshape_value


def reduced_type(t: TensorType, axes, keepdims: bool) -> TensorType:
    if keepdims:
        return t.with_shape([1 if i in axes else d for i, d in enumerate(t.shape)])
    return t.with_shape([d for i, d in enumerate(t.shape) if i not in axes])


def expand_reduced(b, v, axes):
    """Re-insert the reduced `axes` (sorted, non-negative) of a keepdims=False result as
    size-1 dims, so it broadcasts against the reduction's input."""
    for ax in sorted(axes):
        v = b.expand_dims(v, axis=ax)
    return v


def _axes(op_or_attrs, t, opname):
    attrs = op_or_attrs if isinstance(op_or_attrs, dict) else op_or_attrs.attrs
    return norm_axes(attrs.get("axes"), t.rank, opname, t.shape)


def _np_axes(a, ndim):
    return tuple(range(ndim)) if a.get("axes") is None else tuple(ax % ndim for ax in a["axes"])


def _keepdims_g(b, op, g):
    """The cotangent with the reduced axes restored as size-1 dims."""
    t = op.operands[0].type
    return g if op.attrs["keepdims"] else expand_reduced(b, g, _axes(op, t, op.opname))


# -- sum / max / min ------------------------------------------------------------------
def _reduction(name, np_fn, init, combine, vjp, doc):
    def infer(types, a):
        (t,) = types
        if t.dtype == "i1":
            raise TraceError(f"{name}: cannot reduce a boolean tensor {fmt_shape(t.shape)}",
                             hint="cast it to int32 or float32 first")
        return [reduced_type(t, _axes(a, t, name), a["keepdims"])]

    def reference(xs, a):
        x = xs[0]
        return [np.asarray(np_fn(x, axis=_np_axes(a, x.ndim), keepdims=a["keepdims"])).astype(x.dtype)]

    def lower(ctx, op, xs):
        t = op.operands[0].type
        axes = _axes(op, t, name)
        flat = reduced_type(t, axes, False)
        x = xs[0]
        if name == "sum" and sums_batch_of_matmul(op.operands[0], axes):
            x = fence(ctx, x, t)
        out = emit_reduction(ctx, x, t, axes, init(t.dtype), combine(t.dtype))
        return [reshape_value(ctx, out, flat, op.results[0].type)]

    return register(OpDef(name, "reduce", infer, reference, attrs={"axes": None, "keepdims": False},
                          lower=lower, vjp=vjp, method=name, doc=doc))


def sums_batch_of_matmul(v, axes) -> bool:
    """Is a sum over `axes` of `v` a sum over batch dims (not M, N) of the batched matmul
    that produced v? A matrix's cotangent through a matmul broadcast over a batch (W @
    x[B, ...], BitConv2d's W @ rows^T with weights as inputs) is such a sum of a
    batched matmul (tercomp/ops/linalg.py, unbroadcast). IREE 3.13 fuses the sum into the
    contraction, one reduction over B * K that its default CPU pipeline runs far below
    a batched matmul's speed: a 64x576 weight gradient over 32 x 1024 rows took 10.2 s
    as one generic against 130 ms as a batch_matmul and a sum over its [32, 64, 576]
    result (bench/RESULTS.md), so the sum's input is fenced."""
    p = v.producer
    return p is not None and p.opname == "matmul" and v.type.rank > 2 \
        and all(a < v.type.rank - 2 for a in axes)


def emit_reduction(ctx, x, t: TensorType, axes, init_value, combine):
    """linalg.generic(s) reducing `axes` of x (type t) into a filled init; keepdims=False.

    Reduced axes that are not adjacent are reduced one contiguous run at a time
    (innermost run first): IREE 3.13's SPIR-V backend fails on a single generic that
    reduces non-adjacent axes when one of them is dynamic ("'vector.transfer_read' op
    with rank > 1 should be broken down by prior passes")."""
    runs = []
    for a in sorted(axes):
        if runs and runs[-1][-1] == a - 1:
            runs[-1].append(a)
        else:
            runs.append([a])
    for run in reversed(runs) if runs else [[]]:
        out = reduced_type(t, run, False)
        in_map, out_map, iters = reduction_maps(t.rank, run)
        x = ctx.generic([x], [in_map], out, out_map, iters, combine, init=ctx.fill(out, init_value))
        t = out
    return x


def reduction_maps(rank: int, axes):
    """(input map, output map, iterators) of a reduction in canonical loop order: the
    kept axes first (parallel), then the reduced axes (reduction)."""
    kept = [i for i in range(rank) if i not in axes]
    loop_of = {a: k for k, a in enumerate(kept + sorted(axes))}
    return (affine_map(rank, [loop_of[a] for a in range(rank)]),
            affine_map(rank, list(range(len(kept)))),
            [PARALLEL] * len(kept) + [REDUCTION] * len(axes))


def _extreme(dtype, sign):
    if is_float(dtype):
        return sign * float("inf")
    info = np.iinfo(numpy_dtype(dtype))
    return int(info.max if sign > 0 else info.min)


def _add(dtype):
    return lambda x, acc: (arith.AddFOp if is_float(dtype) else arith.AddIOp)(x, acc).result


def _max(dtype):
    # maximumf propagates NaN, as np.max does.
    return lambda x, acc: (arith.MaximumFOp if is_float(dtype) else arith.MaxSIOp)(x, acc).result


def _min(dtype):
    return lambda x, acc: (arith.MinimumFOp if is_float(dtype) else arith.MinSIOp)(x, acc).result


def _sum_vjp(b, op, cts):
    x = op.operands[0]
    g = _keepdims_g(b, op, cts[0])
    return [b.broadcast_to(g, shape=[dim_to_attr(d) for d in x.shape])]


def _extremum_vjp(b, op, cts):
    # mask / count: ties share the cotangent equally; eq and the count carry no gradient.
    x, m = op.operands[0], op.results[0]
    axes = _axes(op, x.type, op.opname)
    m = m if op.attrs["keepdims"] else expand_reduced(b, m, axes)
    mask = b.cast(b.eq(x, m), dtype=x.dtype)
    count = b.sum(mask, axes=axes, keepdims=True)
    return [b.mul(_keepdims_g(b, op, cts[0]), b.div(mask, count))]


_reduction("sum", np.sum, lambda dt: 0, _add, _sum_vjp, "sum over axes (default all)")
_reduction("max", np.max, lambda dt: _extreme(dt, -1), _max, _extremum_vjp,
           "max over axes; the gradient is shared equally among ties")
_reduction("min", np.min, lambda dt: _extreme(dt, +1), _min, _extremum_vjp,
           "min over axes; the gradient is shared equally among ties")


# -- argmax ----------------------------------------------------------------------------
def _argmax_infer(types, a):
    (t,) = types
    if t.rank == 0:
        raise TraceError("argmax: needs a tensor of rank >= 1, got a scalar")
    ax = norm_axes([a["axis"]], t.rank, "argmax", t.shape)
    return [reduced_type(t, ax, a["keepdims"]).with_dtype("i32")]


def _argmax_ref(xs, a):
    x = xs[0]
    return [np.argmax(x, axis=a["axis"] % x.ndim, keepdims=a["keepdims"]).astype(np.int32)]


def _argmax_lower(ctx, op, xs):
    # One generic with two outputs, (running max, its index); a strictly greater value
    # (or the first NaN, as NumPy) replaces the running pair, so ties keep the first index.
    t = op.operands[0].type
    (ax,) = norm_axes([op.attrs["axis"]], t.rank, "argmax", t.shape)
    val_t = reduced_type(t, [ax], False)
    idx_t = val_t.with_dtype("i32")
    in_map, out_map, iters = reduction_maps(t.rank, [ax])
    gen = linalg.GenericOp([tensor_type(val_t), tensor_type(idx_t)], [xs[0]],
                           [ctx.fill(val_t, _extreme(t.dtype, -1)), ctx.fill(idx_t, 0)],
                           maps_attr([in_map, out_map, out_map]), iterator_attr(iters))
    et, i32 = elem_type(t.dtype), elem_type("i32")
    block = gen.regions[0].blocks.append(et, et, i32)
    with ir.InsertionPoint(block):
        x, best, best_i = block.arguments
        k = arith.IndexCastOp(i32, linalg.IndexOp(t.rank - 1).result).result  # the reduced loop
        if is_float(t.dtype):
            greater = arith.CmpFOp(arith.CmpFPredicate.OGT, x, best).result
            x_nan = arith.CmpFOp(arith.CmpFPredicate.UNO, x, x).result
            best_num = arith.CmpFOp(arith.CmpFPredicate.ORD, best, best).result
            take = arith.OrIOp(greater, arith.AndIOp(x_nan, best_num).result).result
        else:
            take = arith.CmpIOp(arith.CmpIPredicate.sgt, x, best).result
        linalg.YieldOp([arith.SelectOp(take, x, best).result, arith.SelectOp(take, k, best_i).result])
    return [reshape_value(ctx, gen.results[1], idx_t, op.results[0].type)]


register(OpDef("argmax", "reduce", _argmax_infer, _argmax_ref,
               attrs={"axis": REQUIRED, "keepdims": False}, lower=_argmax_lower,
               differentiable=False, method="argmax", doc="index (i32) of the first maximum along axis"))


# -- mean (composite) ------------------------------------------------------------------
def _mean_infer(types, a):
    (t,) = types
    if not is_float(t.dtype):
        raise TraceError(f"mean: needs a floating-point tensor, got {t.dtype}",
                         hint="cast it to float32 first")
    return [reduced_type(t, _axes(a, t, "mean"), a["keepdims"])]


def _mean_ref(xs, a):
    x = xs[0]
    return [np.asarray(np.mean(x, axis=_np_axes(a, x.ndim), keepdims=a["keepdims"])).astype(x.dtype)]


def _mean_decompose(b, operands, attrs):
    (x,) = operands
    kw = {"axes": attrs["axes"]} if attrs.get("axes") is not None else {}
    return [b.div(b.sum(x, keepdims=attrs["keepdims"], **kw), b.size(x, **kw))]


def _mean_vjp(b, op, cts):
    # Written out (rather than differentiating sum / size) so no cotangent of size is built.
    x = op.operands[0]
    kw = {"axes": op.attrs["axes"]} if op.attrs.get("axes") is not None else {}
    g = b.div(_keepdims_g(b, op, cts[0]), b.size(x, **kw))
    return [b.broadcast_to(g, shape=[dim_to_attr(d) for d in x.shape])]


register(OpDef("mean", "reduce", _mean_infer, _mean_ref, attrs={"axes": None, "keepdims": False},
               decompose=_mean_decompose, vjp=_mean_vjp, method="mean",
               doc="mean over axes (default all): sum / size"))
