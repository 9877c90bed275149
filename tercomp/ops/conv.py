"""Convolutions: conv and its two transposes (conv_transpose, conv_weight_grad), on
PyTorch's layout: x [N, C, *spatial] with 1 to 3 spatial dims, weights
[O, C // groups, *kernel]. (The pools, which share the geometry, are in pool.py.)

The batch dim may be symbolic, and so may a spatial dim convolved with stride 1 (a
sequence length: Mamba's causal conv1d), whose sizes stay sums. The geometry is
explicit in the IR: `stride` and `dilation` one int per spatial dim,
`padding` one (lo, hi) pair per spatial dim, and `groups`; `tc.conv` turns PyTorch's
and JAX's spellings ("same", an int, ...) into this form.

The three convolution ops are one trilinear form read three ways,

    sum  x_pad[n, g*Cg + c, p*s + k*d] * w[g*Og + o, c, k] * y[n, g*Og + o, p]

with y = conv(x, w), x = conv_transpose(y, w) and w = conv_weight_grad(x, y). So each
one's VJP is the other two (JAX's conv rules are the same closed set, written with
dimension numbers instead), and grad-of-grad never leaves these ops. conv_transpose
needs `output_padding` (the input size is not determined by the output's when stride >
1) and conv_weight_grad the `kernel` size, for the same reason.

Each lowers to one linalg.generic over the padded (zero-filled + tensor.insert_slice)
input, with the group split into its own loop by tensor.expand_shape so that every map
but the windowed one is a projection: conv reads x_pad[n, g, c, p*s + k*d];
conv_transpose reads the cotangent spread by the stride and padded by d*(k-1)
(`_spread`) at the flipped window offsets, i + lo + (K-1-k)*d; conv_weight_grad reduces over
(n, p).
On llvm-cpu (IREE 3.13) the generic form is close to linalg.conv_2d_nchw_fchw: x [8, 64,
18, 18], 3x3, 64 outputs, best of 50 runs 1.35-1.42 ms against 1.16-1.30 ms on the
loaded 2-core VM; one form serves every rank, group count and dilation, and a named
2-D form for groups == 1 is the next step if that gap matters.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from iree.compiler import ir
from iree.compiler.dialects import arith, tensor

from ..codegen.builders import PARALLEL, REDUCTION
from ..errors import TraceError
from ..ir import TensorType, as_dim, is_static
from ..ir.types import dtype_name, is_float
from .registry import OpDef, REQUIRED, register
from .shape_util import _slice_parts, fmt_shape, reshape_value, same_dim, sym

_RANK_HINT = "x is [N, C, *spatial] with 1, 2 or 3 spatial dims (PyTorch's layout)"


@dataclass(frozen=True)
class Geometry:
    """The checked geometry of one convolution or pool: per spatial dim the input size
    X, kernel K, output size P, stride s, dilation d and padding (lo, hi)."""
    stride: tuple
    dilation: tuple
    pads: tuple
    kernel: tuple
    in_size: tuple
    out_size: tuple
    groups: int = 1

    @property
    def nd(self):
        return len(self.kernel)

    @property
    def padded(self):
        return tuple(as_dim(sym(x) + lo + hi) for x, (lo, hi) in zip(self.in_size, self.pads))

    @property
    def output_padding(self):
        """Per dim, the trailing input positions that no window reaches (< stride; 0 on
        a symbolic dim, which has stride 1)."""
        return tuple((xp - d * (k - 1) - 1) % s if is_static(xp) else 0 for xp, d, k, s in
                     zip(self.padded, self.dilation, self.kernel, self.stride))


def _is_int(v):
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _int_list(a, name, nd, opname, minimum):
    v = a[name]
    if not isinstance(v, (list, tuple)) or len(v) != nd or not all(_is_int(i) and i >= minimum for i in v):
        what = "positive" if minimum == 1 else "non-negative"
        raise TraceError(f"{opname}: {name} must be {nd} {what} int{'s' * (nd > 1)} (one per "
                         f"spatial dim), got {v!r}")
    return tuple(int(i) for i in v)


def _pads(a, nd, opname):
    v = a["padding"]
    ok = isinstance(v, (list, tuple)) and len(v) == nd and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and all(_is_int(i) and i >= 0 for i in p) for p in v)
    if not ok:
        raise TraceError(f"{opname}: padding must be {nd} (lo, hi) pairs of non-negative ints "
                         f"(one per spatial dim), got {v!r}")
    return tuple((int(lo), int(hi)) for lo, hi in v)


def _check_input(t: TensorType, opname, what="x"):
    if not 3 <= t.rank <= 5:
        raise TraceError(f"{opname}: {what} of shape {fmt_shape(t.shape)} has rank {t.rank}; it must "
                         f"have rank 3, 4 or 5", hint=_RANK_HINT)
    if not is_float(t.dtype):
        raise TraceError(f"{opname}: {what} must be a floating-point tensor, got {t.dtype}",
                         hint="cast it to float32 first")
    if not is_static(t.shape[1]):
        raise TraceError(f"{opname}: {what} {fmt_shape(t.shape)} must have a static channel dim")
    return t.rank - 2


def _symbolic_needs_stride_1(size, stride, opname, what="x"):
    """A symbolic spatial dim (a sequence length) is allowed with stride 1, where the
    sizes stay sums (L + lo + hi - span + 1), never with a floor division."""
    for i, (x, s) in enumerate(zip(size, stride)):
        if not is_static(x) and s != 1:
            raise TraceError(f"{opname}: spatial dim {i} of {what} has the symbolic size {x}, which "
                             f"needs stride 1 (got {s})", hint="give that input a static size")


def _check_pair(a: TensorType, b: TensorType, opname, names):
    if a.rank != b.rank:
        raise TraceError(f"{opname}: {names[0]} {fmt_shape(a.shape)} and {names[1]} "
                         f"{fmt_shape(b.shape)} must have the same rank", hint=_RANK_HINT)
    if a.dtype != b.dtype:
        raise TraceError(f"{opname}: {names[0]} is {a.dtype} but {names[1]} is {b.dtype}",
                         hint="cast one of them with x.astype(dtype)")


def _groups(a, c, o, opname):
    g = a["groups"]
    if not _is_int(g) or g < 1:
        raise TraceError(f"{opname}: groups must be a positive int, got {g!r}")
    if c % g or o % g:
        raise TraceError(f"{opname}: groups={g} must divide both the input channels ({c}) and the "
                         f"output channels ({o})")
    return int(g)


def _window(a, nd, opname):
    """(stride, dilation, pads) of these attrs, checked."""
    stride = _int_list(a, "stride", nd, opname, 1)
    dilation = _int_list(a, "dilation", nd, opname, 1) if "dilation" in a else (1,) * nd
    pads = _pads(a, nd, opname)
    return stride, dilation, pads


def _out_size(in_size, kernel, stride, dilation, pads, opname, kernel_name="kernel"):
    _symbolic_needs_stride_1(in_size, stride, opname)
    out = []
    for i, (x, k, s, d, (lo, hi)) in enumerate(zip(in_size, kernel, stride, dilation, pads)):
        span = d * (k - 1) + 1
        if not is_static(x):
            out.append(as_dim(x + lo + hi - span + 1))
            continue
        if span > x + lo + hi:
            raise TraceError(f"{opname}: the {kernel_name} spans {span} on spatial dim {i}"
                             f"{f' (dilation {d})' if d > 1 else ''}, more than the padded input "
                             f"({x} + {lo + hi} padding = {x + lo + hi})",
                             hint="use a smaller kernel, more padding, or a larger input")
        out.append((x + lo + hi - span) // s + 1)
    return tuple(out)


def conv_geometry(x: TensorType, w: TensorType, a: dict, opname="conv") -> Geometry:
    """The geometry of conv(x, w) with attrs a, or a TraceError naming the argument."""
    nd = _check_input(x, opname, "x")
    _check_input(w, opname, "w")
    _check_pair(x, w, opname, ("x", "w"))
    c, o = int(x.shape[1]), int(w.shape[0])
    groups = _groups(a, c, o, opname)
    if w.shape[1] != c // groups:
        raise TraceError(f"{opname}: w {fmt_shape(w.shape)} must be [O, C // groups, *kernel] = "
                         f"[{o}, {c // groups}, ...] for x {fmt_shape(x.shape)} and groups={groups}")
    stride, dilation, pads = _window(a, nd, opname)
    kernel, in_size = tuple(int(k) for k in w.shape[2:]), tuple(x.shape[2:])
    out = _out_size(in_size, kernel, stride, dilation, pads, opname)
    return Geometry(stride, dilation, pads, kernel, in_size, out, groups)


def _transpose_geometry(g: TensorType, w: TensorType, a: dict, opname="conv_transpose") -> Geometry:
    nd = _check_input(g, opname, "x")
    _check_input(w, opname, "w")
    _check_pair(g, w, opname, ("x", "w"))
    o = int(g.shape[1])
    if w.shape[0] != o:
        raise TraceError(f"{opname}: w {fmt_shape(w.shape)} must be [C_in, C_out // groups, *kernel] "
                         f"with C_in = {o}, the channels of x {fmt_shape(g.shape)}")
    groups = a["groups"]
    if not _is_int(groups) or groups < 1 or o % groups:
        raise TraceError(f"{opname}: groups must be a positive int dividing the {o} channels of x "
                         f"(C_in), got {groups!r}")
    groups = int(groups)
    stride, dilation, pads = _window(a, nd, opname)
    r = _int_list(a, "output_padding", nd, opname, 0)
    kernel, out = tuple(int(k) for k in w.shape[2:]), tuple(g.shape[2:])
    _symbolic_needs_stride_1(out, stride, opname)
    for i, (ri, s) in enumerate(zip(r, stride)):
        if ri >= s:
            raise TraceError(f"{opname}: output_padding {list(r)} must be smaller than the stride "
                             f"{list(stride)} on spatial dim {i}")
    in_size = tuple(as_dim((sym(p) - 1) * s - lo - hi + d * (k - 1) + 1 + ri) for p, s, (lo, hi), d, k, ri in
                    zip(out, stride, pads, dilation, kernel, r))
    if any(is_static(x) and x < 1 for x in in_size):
        raise TraceError(f"{opname}: padding {[list(p) for p in pads]} removes the whole output "
                         f"(size {list(in_size)}) of x {fmt_shape(g.shape)} and w {fmt_shape(w.shape)}")
    return Geometry(stride, dilation, pads, kernel, in_size, out, groups)


def _weight_grad_geometry(x: TensorType, g: TensorType, a: dict, opname="conv_weight_grad") -> Geometry:
    nd = _check_input(x, opname, "x")
    _check_input(g, opname, "g")
    _check_pair(x, g, opname, ("x", "g"))
    groups = _groups(a, int(x.shape[1]), int(g.shape[1]), opname)
    stride, dilation, pads = _window(a, nd, opname)
    kernel = _int_list(a, "kernel", nd, opname, 1)
    in_size = tuple(x.shape[2:])
    out = _out_size(in_size, kernel, stride, dilation, pads, opname)
    if not all(same_dim(p, q) for p, q in zip(g.shape[2:], out)):
        raise TraceError(f"{opname}: g {fmt_shape(g.shape)} must have the spatial size {list(out)} "
                         f"of conv(x {fmt_shape(x.shape)}) with kernel {list(kernel)}")
    return Geometry(stride, dilation, pads, kernel, in_size, out, groups)


def _geo_attrs(geo: Geometry) -> dict:
    return {"stride": list(geo.stride), "padding": [list(p) for p in geo.pads],
            "dilation": list(geo.dilation), "groups": geo.groups}


# -- NumPy references ---------------------------------------------------------------------
def _np_type(v):
    return TensorType(v.shape, dtype_name(v.dtype))


def _np_window(xp, kk, geo):
    """x_pad[:, :, k*d + p*s] for every output position p: [N, C, *P]."""
    idx = tuple(slice(k * d, k * d + s * (p - 1) + 1, s) for k, d, s, p in
                zip(kk, geo.dilation, geo.stride, geo.out_size))
    return (slice(None), slice(None)) + idx


def _np_pad(x, geo, value=0.0):
    return np.pad(x, [(0, 0), (0, 0)] + list(geo.pads), constant_values=value)


def _split_groups(v, groups, axis):
    shape = v.shape
    return v.reshape(shape[:axis] + (groups, shape[axis] // groups) + shape[axis + 1:])


def _conv_ref(xs, a):
    x, w = xs
    geo = conv_geometry(_np_type(x), _np_type(w), a)
    xp, G = _np_pad(x, geo), geo.groups
    wg = _split_groups(w, G, 0)                                  # [G, Og, Cg, *K]
    y = np.zeros((x.shape[0], G, w.shape[0] // G) + geo.out_size, x.dtype)
    for kk in np.ndindex(*geo.kernel):
        win = _split_groups(xp[_np_window(xp, kk, geo)], G, 1)   # [N, G, Cg, *P]
        y += np.einsum("ngc...,goc->ngo...", win, wg[(Ellipsis,) + kk])
    return [y.reshape((x.shape[0], w.shape[0]) + geo.out_size)]


def _conv_transpose_ref(xs, a):
    g, w = xs
    geo = _transpose_geometry(_np_type(g), _np_type(w), a)
    G, n = geo.groups, g.shape[0]
    c = w.shape[1] * G
    xp = np.zeros((n, c) + geo.padded, g.dtype)
    gg, wg = _split_groups(g, G, 1), _split_groups(w, G, 0)
    for kk in np.ndindex(*geo.kernel):
        part = np.einsum("ngo...,goc->ngc...", gg, wg[(Ellipsis,) + kk])
        xp[_np_window(xp, kk, geo)] += part.reshape((n, c) + geo.out_size)
    crop = tuple(slice(lo, lo + x) for (lo, _), x in zip(geo.pads, geo.in_size))
    return [xp[(slice(None), slice(None)) + crop].copy()]


def _conv_weight_grad_ref(xs, a):
    x, g = xs
    geo = _weight_grad_geometry(_np_type(x), _np_type(g), a)
    xp, G = _np_pad(x, geo), geo.groups
    gg = _split_groups(g, G, 1)                                  # [N, G, Og, *P]
    o, cg = g.shape[1], x.shape[1] // G
    dw = np.zeros((G, o // G, cg) + geo.kernel, x.dtype)
    for kk in np.ndindex(*geo.kernel):
        win = _split_groups(xp[_np_window(xp, kk, geo)], G, 1)
        sp = "xyz"[:geo.nd]
        dw[(Ellipsis,) + kk] = np.einsum(f"ngc{sp},ngo{sp}->goc", win, gg)
    return [dw.reshape((o, cg) + geo.kernel)]


# -- MLIR lowering --------------------------------------------------------------------------
def _aff(i):
    return ir.AffineDimExpr.get(i)


def _place(ctx, v, t: TensorType, shape, offsets, strides, fill):
    """A tensor of `shape` filled with `fill` holding v (of type t) at `offsets`, every
    `strides` elements (tensor.insert_slice into a linalg.fill); v itself if that is all."""
    out_t = t.with_shape(tuple(shape))
    if all(o == 0 for o in offsets) and all(s == 1 for s in strides) and \
            all(same_dim(a, b) for a, b in zip(t.shape, shape)):
        return v, out_t
    parts = _slice_parts(ctx, offsets, t.shape, strides)
    return tensor.InsertSliceOp(v, ctx.fill(out_t, fill), *parts).result, out_t


def _pad_input(ctx, v, t: TensorType, geo: Geometry, fill=0.0):
    return _place(ctx, v, t, t.shape[:2] + geo.padded, [0, 0] + [lo for lo, _ in geo.pads],
                  [1] * t.rank, fill)


def _grouped(ctx, v, t: TensorType, axis: int, groups: int):
    """v with dim `axis` split into [groups, dim // groups] (a tensor.expand_shape)."""
    d = t.shape[axis]
    gt = t.with_shape(t.shape[:axis] + (groups, d // groups) + t.shape[axis + 1:])
    return reshape_value(ctx, v, t, gt), gt


def _contract(ctx, ins, maps, out_t: TensorType, out_map, n_par, n_red):
    """One generic: sum over the reduction loops of in0 * in1 into a zero-filled out_t."""
    fl = is_float(out_t.dtype)

    def body(a, b, acc):
        prod = (arith.MulFOp if fl else arith.MulIOp)(a, b).result
        return (arith.AddFOp if fl else arith.AddIOp)(acc, prod).result

    n = n_par + n_red
    maps = [ir.AffineMap.get(n, 0, m) for m in maps]
    return ctx.generic(ins, maps, out_t, ir.AffineMap.get(n, 0, out_map),
                       [PARALLEL] * n_par + [REDUCTION] * n_red, body, init=ctx.fill(out_t, 0))


def _conv_lower(ctx, op, xs):
    x_t, w_t = (v.type for v in op.operands)
    geo = conv_geometry(x_t, w_t, op.attrs)
    G, nd = geo.groups, geo.nd
    xp, xp_t = _pad_input(ctx, xs[0], x_t, geo)
    xg, _ = _grouped(ctx, xp, xp_t, 1, G)
    wg, _ = _grouped(ctx, xs[1], w_t, 0, G)
    y_t = op.results[0].type
    yg_t = y_t.with_shape((y_t.shape[0], G, y_t.shape[1] // G) + geo.out_size)
    # loops: n g o p... | c k...
    n, g, o, c = 0, 1, 2, 3 + nd
    p = [3 + i for i in range(nd)]
    k = [4 + nd + i for i in range(nd)]
    x_map = [_aff(n), _aff(g), _aff(c)] + [_aff(p[i]) * geo.stride[i] + _aff(k[i]) * geo.dilation[i]
                                          for i in range(nd)]
    w_map = [_aff(g), _aff(o), _aff(c)] + [_aff(ki) for ki in k]
    y_map = [_aff(n), _aff(g), _aff(o)] + [_aff(pi) for pi in p]
    y = _contract(ctx, [xg, wg], [x_map, w_map], yg_t, y_map, 3 + nd, 1 + nd)
    return [reshape_value(ctx, y, yg_t, y_t)]


def _spread(ctx, v, t: TensorType, geo: Geometry):
    """The cotangent g [N, O, *P] of conv's output at stride spacing, after d*(k-1)
    zeros and before enough zeros that every input position's window fits: the input of
    conv_transpose's direct (stride 1, flipped kernel) form."""
    lead = [d * (k - 1) for d, k in zip(geo.dilation, geo.kernel)]
    length = [_larger(l0 + (sym(p) - 1) * s + 1, sym(x) + lo + l0)
              for l0, p, s, x, (lo, _) in zip(lead, geo.out_size, geo.stride, geo.in_size, geo.pads)]
    return _place(ctx, v, t, t.shape[:2] + tuple(length), [0, 0] + lead, [1, 1] + list(geo.stride), 0.0)


def _larger(a, b):
    """The larger of two dims whose difference is a number (both static, or the same
    symbolic length plus constants: stride 1)."""
    return as_dim(a if (sym(a) - sym(b)) >= 0 else b)


def _conv_transpose_lower(ctx, op, xs):
    g_t, w_t = (v.type for v in op.operands)
    geo = _transpose_geometry(g_t, w_t, op.attrs)
    G, nd = geo.groups, geo.nd
    gs, gs_t = _spread(ctx, xs[0], g_t, geo)
    gg, _ = _grouped(ctx, gs, gs_t, 1, G)
    wg, _ = _grouped(ctx, xs[1], w_t, 0, G)
    x_t = op.results[0].type
    xg_t = x_t.with_shape((x_t.shape[0], G, x_t.shape[1] // G) + geo.in_size)
    # loops: n g c i... | o k...
    n, g, c, o = 0, 1, 2, 3 + nd
    i = [3 + j for j in range(nd)]
    k = [4 + nd + j for j in range(nd)]
    # the flip reads the spread cotangent at i + lo + (K-1-k)*d: each loop then appears
    # bare in some map (linalg needs the maps invertible), which w[K-1-k] would not allow
    g_map = [_aff(n), _aff(g), _aff(o)] + [
        _aff(i[j]) - _aff(k[j]) * geo.dilation[j] + (geo.pads[j][0] + (geo.kernel[j] - 1) * geo.dilation[j])
        for j in range(nd)]
    w_map = [_aff(g), _aff(o), _aff(c)] + [_aff(kj) for kj in k]
    x_map = [_aff(n), _aff(g), _aff(c)] + [_aff(ij) for ij in i]
    dx = _contract(ctx, [gg, wg], [g_map, w_map], xg_t, x_map, 3 + nd, 1 + nd)
    return [reshape_value(ctx, dx, xg_t, x_t)]


def _conv_weight_grad_lower(ctx, op, xs):
    x_t, g_t = (v.type for v in op.operands)
    geo = _weight_grad_geometry(x_t, g_t, op.attrs)
    G, nd = geo.groups, geo.nd
    xp, xp_t = _pad_input(ctx, xs[0], x_t, geo)
    xg, _ = _grouped(ctx, xp, xp_t, 1, G)
    gg, _ = _grouped(ctx, xs[1], g_t, 1, G)
    w_t = op.results[0].type
    wg_t = w_t.with_shape((G, w_t.shape[0] // G) + tuple(w_t.shape[1:]))
    # loops: g o c k... | n p...
    g, o, c, n = 0, 1, 2, 3 + nd
    k = [3 + j for j in range(nd)]
    p = [4 + nd + j for j in range(nd)]
    x_map = [_aff(n), _aff(g), _aff(c)] + [_aff(p[j]) * geo.stride[j] + _aff(k[j]) * geo.dilation[j]
                                          for j in range(nd)]
    g_map = [_aff(n), _aff(g), _aff(o)] + [_aff(pj) for pj in p]
    w_map = [_aff(g), _aff(o), _aff(c)] + [_aff(kj) for kj in k]
    dw = _contract(ctx, [xg, gg], [x_map, g_map], wg_t, w_map, 3 + nd, 1 + nd)
    return [reshape_value(ctx, dw, wg_t, w_t)]


# -- shape rules and VJPs -----------------------------------------------------------------
def _conv_infer(types, a):
    x, w = types
    geo = conv_geometry(x, w, a)
    return [TensorType((x.shape[0], w.shape[0]) + geo.out_size, x.dtype)]


def _conv_transpose_infer(types, a):
    g, w = types
    geo = _transpose_geometry(g, w, a)
    return [TensorType((g.shape[0], w.shape[1] * geo.groups) + geo.in_size, g.dtype)]


def _conv_weight_grad_infer(types, a):
    x, g = types
    geo = _weight_grad_geometry(x, g, a)
    return [TensorType((g.shape[1], x.shape[1] // geo.groups) + geo.kernel, x.dtype)]


def _conv_vjp(b, op, cts):
    x, w = op.operands
    geo = conv_geometry(x.type, w.type, op.attrs)
    g, attrs = cts[0], _geo_attrs(geo)
    return [b.conv_transpose(g, w, output_padding=list(geo.output_padding), **attrs),
            b.conv_weight_grad(x, g, kernel=list(geo.kernel), **attrs)]


def _conv_transpose_vjp(b, op, cts):
    g, w = op.operands
    geo = _transpose_geometry(g.type, w.type, op.attrs)
    ct, attrs = cts[0], _geo_attrs(geo)
    return [b.conv(ct, w, **attrs), b.conv_weight_grad(ct, g, kernel=list(geo.kernel), **attrs)]


def _conv_weight_grad_vjp(b, op, cts):
    x, g = op.operands
    geo = _weight_grad_geometry(x.type, g.type, op.attrs)
    ct, attrs = cts[0], _geo_attrs(geo)
    return [b.conv_transpose(g, ct, output_padding=list(geo.output_padding), **attrs),
            b.conv(x, ct, **attrs)]


_GEOMETRY = {"stride": REQUIRED, "padding": REQUIRED, "dilation": REQUIRED, "groups": 1}

register(OpDef("conv", "conv", _conv_infer, _conv_ref, num_operands=2, attrs=dict(_GEOMETRY),
               lower=_conv_lower, vjp=_conv_vjp,
               doc="N-d convolution (cross-correlation) of x [N, C, *S] with w [O, C // groups, *K]"))
register(OpDef("conv_transpose", "conv", _conv_transpose_infer, _conv_transpose_ref, num_operands=2,
               attrs={**_GEOMETRY, "output_padding": REQUIRED},
               lower=_conv_transpose_lower, vjp=_conv_transpose_vjp,
               doc="the transpose of conv in x: x [N, C_in, *S] with w [C_in, C_out // groups, *K]"))
register(OpDef("conv_weight_grad", "conv", _conv_weight_grad_infer, _conv_weight_grad_ref,
               num_operands=2, attrs={**_GEOMETRY, "kernel": REQUIRED},
               lower=_conv_weight_grad_lower, vjp=_conv_weight_grad_vjp,
               doc="the transpose of conv in w: sum over n, p of x_pad[n, c, p*s + k*d] g[n, o, p]"))
