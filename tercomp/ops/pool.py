"""Pools over x [N, C, *spatial] (1 to 3 spatial dims), with PyTorch's conventions and
the geometry of conv.py (`window`, `stride`, `padding` (lo, hi) pairs, at most half the
window):

* ``max_pool``: one linalg.generic reduction over the -inf padded input (with an unread
  operand of the window's shape, as linalg.pooling_nchw_max, so its maps are
  invertible); its VJP sends the cotangent to the first maximum of each window, written
  with strided slices so that grad-of-grad works.
* ``avg_pool``: PyTorch's count_include_pad mean, a depthwise conv with the constant
  weight 1 / window size (a decomposition: its gradient is conv's).
"""
from __future__ import annotations

import itertools

import numpy as np
from iree.compiler import ir
from iree.compiler.dialects import arith

from ..codegen.builders import PARALLEL, REDUCTION
from ..errors import TraceError
from ..ir import TensorType, is_static, numpy_dtype
from .conv import (Geometry, _aff, _check_input, _int_list, _np_pad, _np_type, _np_window, _out_size,
                   _pad_input, _window)
from .registry import OpDef, REQUIRED, register
from .shape_util import SLICE_END, dim_to_attr, fence, fmt_shape


def pool_geometry(x: TensorType, a: dict, opname) -> Geometry:
    nd = _check_input(x, opname, "x")
    if not all(is_static(d) for d in x.shape[2:]):
        raise TraceError(f"{opname}: x {fmt_shape(x.shape)} must have static spatial dims "
                         f"(only the batch dim may be symbolic)")
    window = _int_list(a, "window", nd, opname, 1)
    stride, _, pads = _window(a, nd, opname)
    for i, ((lo, hi), k) in enumerate(zip(pads, window)):
        if max(lo, hi) > k // 2:
            raise TraceError(f"{opname}: padding {[list(p) for p in pads]} is more than half the "
                             f"window {list(window)} on spatial dim {i}",
                             hint="a window must overlap the input (PyTorch's rule: padding <= window // 2)")
    in_size = tuple(int(d) for d in x.shape[2:])
    out = _out_size(in_size, window, stride, (1,) * nd, pads, opname, "window")
    return Geometry(stride, (1,) * nd, pads, window, in_size, out)


def _pool_infer(opname):
    def infer(types, a):
        (x,) = types
        geo = pool_geometry(x, a, opname)
        return [x.with_shape(x.shape[:2] + geo.out_size)]
    return infer


def _max_pool_ref(xs, a):
    (x,) = xs
    geo = pool_geometry(_np_type(x), a, "max_pool")
    xp = _np_pad(x, geo, -np.inf)
    wins = [xp[_np_window(xp, kk, geo)] for kk in np.ndindex(*geo.kernel)]
    return [np.max(np.stack(wins), axis=0)]


def _max_pool_lower(ctx, op, xs):
    x_t = op.operands[0].type
    geo = pool_geometry(x_t, op.attrs, "max_pool")
    nd = geo.nd
    x = xs[0]
    src = op.operands[0].producer
    if src is not None and src.opname in ("max", "sum"):
        # a reduction's result pooled (BitConv's patch absmax: the max over channels,
        # then over windows) stays its own dispatch: IREE 3.13 fused the two into one
        # C x window reduction a position, C times the pool's reads (bench/RESULTS.md)
        x = fence(ctx, x, x_t)
    xp, _ = _pad_input(ctx, x, x_t, geo, float("-inf"))
    p = [2 + i for i in range(nd)]
    k = [2 + nd + i for i in range(nd)]
    x_map = [_aff(0), _aff(1)] + [_aff(p[i]) * geo.stride[i] + _aff(k[i]) for i in range(nd)]
    y_map = [_aff(0), _aff(1)] + [_aff(pi) for pi in p]
    y_t = op.results[0].type
    n = 2 + 2 * nd
    # an unread operand of the window's shape gives the window loops a map of their own
    # (linalg needs the maps invertible), as linalg.pooling_nchw_max does
    window = ctx.empty(TensorType(geo.kernel, y_t.dtype))
    return [ctx.generic([xp, window], [ir.AffineMap.get(n, 0, x_map),
                                       ir.AffineMap.get(n, 0, [_aff(ki) for ki in k])],
                        y_t, ir.AffineMap.get(n, 0, y_map),
                        [PARALLEL] * (2 + nd) + [REDUCTION] * nd,
                        lambda v, _w, acc: arith.MaximumFOp(v, acc).result,
                        init=ctx.fill(y_t, float("-inf")))]


def _slice_attrs(t: TensorType, starts, sizes, steps):
    """slice/unslice attributes taking [starts, starts + sizes * steps) of the spatial dims
    of t at `steps`, and its batch and channel dims whole."""
    return {"starts": [0, 0] + list(starts),
            "stops": [SLICE_END, int(t.shape[1])] + [s + (n - 1) * st + 1 for s, n, st in
                                                     zip(starts, sizes, steps)],
            "steps": [1, 1] + list(steps)}


def _max_pool_vjp(b, op, cts):
    """The cotangent goes to the first maximum of each window (in row-major window
    order, as PyTorch's max_pool): window offset by offset, the positions equal to the
    result that no earlier offset took get g. Written in slices, so grad-of-grad works."""
    x, y, g = op.operands[0], op.results[0], cts[0]
    geo = pool_geometry(x.type, op.attrs, "max_pool")
    dt = x.dtype
    padded_shape = [dim_to_attr(x.type.shape[0]), int(x.type.shape[1])] + list(geo.padded)
    pad_attrs = {"shape": padded_shape, **_slice_attrs(x.type, [lo for lo, _ in geo.pads],
                                                        geo.in_size, [1] * geo.nd)}
    xp = x
    if any(lo or hi for lo, hi in geo.pads):
        # -inf where the padding is, so a pad never equals a window's max
        inside = np.zeros(geo.padded, bool)
        inside[tuple(slice(lo, lo + n) for (lo, _), n in zip(geo.pads, geo.in_size))] = True
        xp = b.where(b.constant(inside, name="inside"), b.unslice(x, **pad_attrs),
                     b.scalar(float("-inf"), dt))
    xp_t = x.type.with_shape(x.type.shape[:2] + geo.padded)
    one = b.scalar(1.0, dt)
    taken, dxp = None, None
    for kk in itertools.product(*(range(k) for k in geo.kernel)):
        at = _slice_attrs(xp_t, kk, geo.out_size, geo.stride)
        hit = b.cast(b.eq(b.slice(xp, **at), y), dtype=dt)
        if taken is not None:
            hit = b.mul(hit, b.sub(one, taken))
        taken = hit if taken is None else b.add(taken, hit)
        part = b.unslice(b.mul(g, hit), shape=padded_shape, **at)
        dxp = part if dxp is None else b.add(dxp, part)
    if xp is x:
        return [dxp]
    return [b.slice(dxp, **{k: pad_attrs[k] for k in ("starts", "stops", "steps")})]


_POOL = {"window": REQUIRED, "stride": REQUIRED, "padding": REQUIRED}

register(OpDef("max_pool", "pool", _pool_infer("max_pool"), _max_pool_ref, attrs=dict(_POOL),
               lower=_max_pool_lower, vjp=_max_pool_vjp,
               doc="max over windows of x [N, C, *S] (-inf padding); the gradient goes to the "
                   "first maximum of each window"))


def _avg_pool_ref(xs, a):
    (x,) = xs
    geo = pool_geometry(_np_type(x), a, "avg_pool")
    xp = _np_pad(x, geo)
    total = sum(xp[_np_window(xp, kk, geo)] for kk in np.ndindex(*geo.kernel))
    return [(total / np.prod(geo.kernel)).astype(x.dtype)]


def _avg_pool_decompose(b, operands, a):
    (x,) = operands
    geo = pool_geometry(x.type, a, "avg_pool")
    c = int(x.type.shape[1])
    w = np.full((c, 1) + geo.kernel, 1.0 / np.prod(geo.kernel), dtype=numpy_dtype(x.dtype))
    w = b.constant(w, name="window")
    return [b.conv(x, w, stride=list(geo.stride), padding=[list(p) for p in geo.pads],
                   dilation=[1] * geo.nd, groups=c)]


register(OpDef("avg_pool", "pool", _pool_infer("avg_pool"), _avg_pool_ref, attrs=dict(_POOL),
               decompose=_avg_pool_decompose,
               doc="mean over windows of x [N, C, *S], zero padding counted (PyTorch's "
                   "count_include_pad); a depthwise conv"))
