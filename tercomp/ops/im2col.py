"""im2col: the patches of a convolution as rows, the input of a convolution written as a
matmul (nn.BitConv2d's ternary GEMM).

``im2col(x) {kernel, stride, padding, dilation}``: x [N, C, *S] -> [N, *P, C, *K], the
window of output position p at kernel offset k being x_pad[n, c, p*s + k*d] (the
geometry of conv.py; P the output positions of that conv). Reshaped to
[N * P, C * K] it holds one patch per row, its columns in the order of a conv weight's
[C, *kernel] dims.

One all-parallel linalg.generic over the padded input. It replaced a composition (pad,
one strided slice per kernel offset, a stack, a transpose), which took twice its time
(bench/RESULTS.md: 82 ms against 41 ms for a 3x3 128-channel layer's patches at batch
32, 16x16) and a dispatch per kernel offset.

It is linear; its VJP (the col2im) is a sum of unslices of the cotangent's planes, one
per kernel offset, whose own VJPs are slices, so grad-of-grad stays in the shape ops.
"""
from __future__ import annotations

import numpy as np
from iree.compiler import ir

from ..codegen.builders import PARALLEL
from ..ir import TensorType
# the attribute marking the im2col generic (its stride and dilation), defined beside the
# kernel that reads it (kernels sit below ops)
from ..kernels.ternary.im2col_quant import PATCHES_ATTR
from .conv import (Geometry, _aff, _check_input, _int_list, _np_pad, _np_type, _np_window, _out_size,
                   _pad_input, _window)
from .registry import OpDef, REQUIRED, register
from .shape_util import SLICE_END, dim_to_attr



def im2col_geometry(x: TensorType, a: dict, opname="im2col") -> Geometry:
    nd = _check_input(x, opname, "x")
    kernel = _int_list(a, "kernel", nd, opname, 1)
    stride, dilation, pads = _window(a, nd, opname)
    in_size = tuple(x.shape[2:])
    out = _out_size(in_size, kernel, stride, dilation, pads, opname)
    return Geometry(stride, dilation, pads, kernel, in_size, out)


def _infer(types, a):
    (x,) = types
    geo = im2col_geometry(x, a)
    return [TensorType((x.shape[0],) + geo.out_size + (x.shape[1],) + geo.kernel, x.dtype)]


def _reference(xs, a):
    (x,) = xs
    geo = im2col_geometry(_np_type(x), a)
    xp, nd = _np_pad(x, geo), geo.nd
    out = np.zeros((x.shape[0],) + geo.out_size + (x.shape[1],) + geo.kernel, x.dtype)
    for kk in np.ndindex(*geo.kernel):
        win = np.moveaxis(xp[_np_window(xp, kk, geo)], 1, -1)            # [N, *P, C]
        out[(slice(None),) * (2 + nd) + kk] = win
    return [out]


def _lower(ctx, op, xs):
    x_t = op.operands[0].type
    geo = im2col_geometry(x_t, op.attrs)
    nd = geo.nd
    xp, _ = _pad_input(ctx, xs[0], x_t, geo)
    # loops: n p... c k..., all parallel; the output is read in loop order
    p = [1 + i for i in range(nd)]
    c = 1 + nd
    k = [2 + nd + i for i in range(nd)]
    n = 2 + 2 * nd
    x_map = [_aff(0), _aff(c)] + [_aff(p[i]) * geo.stride[i] + _aff(k[i]) * geo.dilation[i]
                                  for i in range(nd)]
    out_t = op.results[0].type
    y = ctx.generic([xp], [ir.AffineMap.get(n, 0, x_map)], out_t,
                    ir.AffineMap.get_identity(n), [PARALLEL] * n, lambda v, _acc: v)
    # the geometry, for a consumer that reads the patches from xp itself (the fused
    # im2col + quantize dispatch of the avx ternary kernels: kernels/ternary/im2col_quant.py)
    i64 = ir.IntegerType.get_signless(64)
    y.owner.attributes[PATCHES_ATTR] = ir.DictAttr.get({
        key: ir.ArrayAttr.get([ir.IntegerAttr.get(i64, int(v)) for v in vals])
        for key, vals in (("stride", geo.stride), ("dilation", geo.dilation))})
    return [y]


def _vjp(b, op, cts):
    """The col2im: x's cotangent is the sum, over the kernel offsets k, of the cotangent's
    [N, C, *P] plane at k put back where im2col took it from the padded input (an
    unslice: zeros with the plane at k*d + p*s), cropped to the input. One read of each
    plane a kernel offset (IREE fuses the unslices' fills, copies and adds), where the
    conv_transpose of a one-hot depthwise weight it replaced reduced over C * K inputs
    per output, 9x the work at 3x3 and the training step's largest dispatches
    (bench/RESULTS.md)."""
    x, g = op.operands[0], cts[0]
    geo = im2col_geometry(x.type, op.attrs)
    nd = geo.nd
    # [N, *P, C, *K] -> [N, C, *K, *P]
    g = b.transpose(g, perm=[0, 1 + nd] + list(range(2 + nd, 2 + 2 * nd)) + list(range(1, 1 + nd)))
    lead = [dim_to_attr(d) for d in x.type.shape[:2]]
    padded = [int(s) + lo + hi for s, (lo, hi) in zip(geo.in_size, geo.pads)]
    total = None
    for kk in np.ndindex(*geo.kernel):
        plane = b.slice(g, starts=[0, 0, *kk] + [0] * nd,
                        stops=[SLICE_END, SLICE_END, *(k + 1 for k in kk)] + [SLICE_END] * nd,
                        steps=[1] * (2 + 2 * nd))
        plane = b.reshape(plane, shape=lead + [int(p) for p in geo.out_size])
        starts = [k * d for k, d in zip(kk, geo.dilation)]
        spread = b.unslice(plane, shape=lead + padded, starts=[0, 0] + starts,
                           stops=[SLICE_END, SLICE_END] + [st + (int(p) - 1) * s + 1 for st, p, s in
                                                           zip(starts, geo.out_size, geo.stride)],
                           steps=[1, 1] + list(geo.stride))
        total = spread if total is None else b.add(total, spread)
    if any(lo or hi for lo, hi in geo.pads):
        ends = [lo + int(s) for (lo, _), s in zip(geo.pads, geo.in_size)]
        total = b.slice(total, starts=[0, 0] + [lo for lo, _ in geo.pads],
                        stops=[SLICE_END, SLICE_END] + ends, steps=[1] * (2 + nd))
    return [total]


register(OpDef("im2col", "conv", _infer, _reference,
               attrs={"kernel": REQUIRED, "stride": REQUIRED, "padding": REQUIRED, "dilation": REQUIRED},
               lower=_lower, vjp=_vjp,
               doc="the patches of a convolution: x [N, C, *S] -> [N, *P, C, *K], x_pad[n, c, p*s + k*d]"))
