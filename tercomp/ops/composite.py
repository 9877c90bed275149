"""Composite ops: defined by a decomposition into other tern ops (no lowering of their
own), a direct NumPy reference, and, where it is more stable or compact than
differentiating the decomposition, a hand-written VJP in tern ops.

softmax, log_softmax and logsumexp subtract the max before exp; their VJPs
(y * (g - sum(g * y)), g - softmax * sum(g), g * softmax) never differentiate through
that max, so their gradients are exact rather than cancelling to ~1e-8.
"""
from __future__ import annotations

import numpy as np

from ..kernels.table import check_attr
from ..errors import TraceError
from ..ir import TensorType, is_static, numpy_dtype
from ..ir.types import is_float
from .reduce import expand_reduced, reduced_type
from .registry import OpDef, REQUIRED, register
from .shape import unbroadcast
from .shape_util import SLICE_END, check_integer_ids, dim_to_attr, fmt_shape, norm_axes, same_dim


def _float_operand(t, opname):
    if not is_float(t.dtype):
        raise TraceError(f"{opname}: needs a floating-point tensor, got {t.dtype} {fmt_shape(t.shape)}",
                         hint="cast it to float32 first")


def _one_axis(t, attrs, opname):
    if t.rank == 0:
        raise TraceError(f"{opname}: needs a tensor of rank >= 1, got a scalar")
    return norm_axes([attrs["axis"]], t.rank, opname, t.shape)[0]


def _same_type_infer(opname):
    def infer(types, attrs):
        (t,) = types
        _float_operand(t, opname)
        _one_axis(t, attrs, opname)
        return [t]
    return infer


def _np_lse(x, axes, keepdims=True):
    """Stable log-sum-exp in NumPy (a non-finite max is replaced by 0 before exp)."""
    m = np.max(x, axis=axes, keepdims=True)
    m = np.where(np.isfinite(m), m, 0).astype(x.dtype)
    with np.errstate(divide="ignore"):
        out = np.log(np.sum(np.exp(x - m), axis=axes, keepdims=True)) + m
    return out if keepdims else np.squeeze(out, axis=axes)


def _lse(b, x, axes):
    """log(sum(exp(x))) over axes, keepdims=True, as tern ops: the max is subtracted
    first, and a non-finite max (a row of -inf) is replaced by 0, as in NumPy."""
    m = b.max(x, axes=axes, keepdims=True)
    inf = b.scalar(float("inf"), x.dtype)
    m = b.where(b.eq(b.abs(m), inf), b.scalar(0.0, x.dtype), m)
    return b.add(b.log(b.sum(b.exp(b.sub(x, m)), axes=axes, keepdims=True)), m)


# -- softmax ----------------------------------------------------------------------------
def _softmax_ref(xs, a):
    x = xs[0]
    ax = a["axis"] % x.ndim
    e = np.exp(x - np.max(x, axis=ax, keepdims=True))
    return [(e / np.sum(e, axis=ax, keepdims=True)).astype(x.dtype)]


def _softmax_decompose(b, operands, a):
    (x,) = operands
    ax = _one_axis(x.type, a, "softmax")
    e = b.exp(b.sub(x, b.max(x, axes=[ax], keepdims=True)))
    return [b.div(e, b.sum(e, axes=[ax], keepdims=True))]


def _softmax_vjp(b, op, cts):
    y, g = op.results[0], cts[0]
    ax = _one_axis(y.type, op.attrs, "softmax")
    return [b.mul(y, b.sub(g, b.sum(b.mul(g, y), axes=[ax], keepdims=True)))]


register(OpDef("softmax", "composite", _same_type_infer("softmax"), _softmax_ref,
               attrs={"axis": -1}, decompose=_softmax_decompose, vjp=_softmax_vjp,
               doc="exp(x - max) / sum(exp(x - max)) along axis"))


# -- log_softmax --------------------------------------------------------------------------
def _log_softmax_decompose(b, operands, a):
    (x,) = operands
    ax = _one_axis(x.type, a, "log_softmax")
    return [b.sub(x, _lse(b, x, [ax]))]


def _log_softmax_vjp(b, op, cts):
    y, g = op.results[0], cts[0]
    ax = _one_axis(y.type, op.attrs, "log_softmax")
    return [b.sub(g, b.mul(b.exp(y), b.sum(g, axes=[ax], keepdims=True)))]


register(OpDef("log_softmax", "composite", _same_type_infer("log_softmax"),
               lambda xs, a: [(xs[0] - _np_lse(xs[0], a["axis"] % xs[0].ndim)).astype(xs[0].dtype)],
               attrs={"axis": -1}, decompose=_log_softmax_decompose, vjp=_log_softmax_vjp,
               doc="x - logsumexp(x) along axis"))


# -- logsumexp ----------------------------------------------------------------------------
def _lse_axes(t, a):
    return norm_axes(a.get("axes"), t.rank, "logsumexp", t.shape)


def _logsumexp_infer(types, a):
    (t,) = types
    _float_operand(t, "logsumexp")
    return [reduced_type(t, _lse_axes(t, a), a["keepdims"])]


def _logsumexp_ref(xs, a):
    x = xs[0]
    axes = tuple(range(x.ndim)) if a.get("axes") is None else tuple(ax % x.ndim for ax in a["axes"])
    return [np.asarray(_np_lse(x, axes, a["keepdims"])).astype(x.dtype)]


def _logsumexp_decompose(b, operands, a):
    (x,) = operands
    axes = _lse_axes(x.type, a)
    out = _lse(b, x, axes)
    return [out if a["keepdims"] or not axes else b.squeeze(out, axes=axes)]


def _logsumexp_vjp(b, op, cts):
    x, y, g = op.operands[0], op.results[0], cts[0]
    axes = _lse_axes(x.type, op.attrs)
    if not op.attrs["keepdims"]:
        y, g = expand_reduced(b, y, axes), expand_reduced(b, g, axes)
    return [b.mul(g, b.exp(b.sub(x, y)))]


register(OpDef("logsumexp", "composite", _logsumexp_infer, _logsumexp_ref,
               attrs={"axes": None, "keepdims": False}, decompose=_logsumexp_decompose,
               vjp=_logsumexp_vjp, doc="log(sum(exp(x))) over axes (default all), max-subtracted"))


# -- layer_norm / rms_norm -------------------------------------------------------------------
def _norm_infer(opname, n_params):
    def infer(types, a):
        x, params = types[0], types[1:]
        _float_operand(x, opname)
        if x.rank == 0:
            raise TraceError(f"{opname}: needs a tensor of rank >= 1, got a scalar")
        for name, p in zip(("weight", "bias"), params):
            if p.rank != 1 or not same_dim(p.shape[0], x.shape[-1]) or p.dtype != x.dtype:
                raise TraceError(f"{opname}: {name} {fmt_shape(p.shape)}{p.dtype} must be "
                                 f"[{x.shape[-1]}]{x.dtype}, the last dim of the input "
                                 f"{fmt_shape(x.shape)}{x.dtype}")
        return [x]
    return infer


def _layer_norm_ref(xs, a):
    x, w, bias = xs
    mu = np.mean(x, axis=-1, keepdims=True)
    xc = x - mu
    var = np.mean(xc * xc, axis=-1, keepdims=True)
    return [(xc / np.sqrt(var + a["eps"]) * w + bias).astype(x.dtype)]


def _layer_norm_decompose(b, operands, a):
    x, w, bias = operands
    last = [x.type.rank - 1]
    xc = b.sub(x, b.mean(x, axes=last, keepdims=True))
    var = b.mean(b.mul(xc, xc), axes=last, keepdims=True)
    inv = b.rsqrt(b.add(var, b.scalar(a["eps"], x.dtype)))
    return [b.add(b.mul(b.mul(xc, inv), w), bias)]


register(OpDef("layer_norm", "composite", _norm_infer("layer_norm", 2), _layer_norm_ref,
               num_operands=3, attrs={"eps": 1e-5}, decompose=_layer_norm_decompose,
               doc="(x - mean) / sqrt(var + eps) * weight + bias over the last dim"))


def _rms_norm_ref(xs, a):
    x, w = xs
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return [(x / np.sqrt(ms + a["eps"]) * w).astype(x.dtype)]


def _rms_norm_decompose(b, operands, a):
    x, w = operands
    ms = b.mean(b.mul(x, x), axes=[x.type.rank - 1], keepdims=True)
    return [b.mul(b.mul(x, b.rsqrt(b.add(ms, b.scalar(a["eps"], x.dtype)))), w)]


def _rms_norm_vjp(b, op, cts):
    """dx = r * (g w - n * mean(g w n)), dw = sum of g n over the rows, with
    r = rsqrt(mean(x^2) + eps) and n = x r: written out, it is half the ops of the
    decomposition's backward (which goes through d rsqrt = -0.5 / pow(., 1.5))."""
    x, w = op.operands
    g, last = cts[0], [x.type.rank - 1]
    ms = b.mean(b.mul(x, x), axes=last, keepdims=True)
    r = b.rsqrt(b.add(ms, b.scalar(op.attrs["eps"], x.dtype)))
    n = b.mul(x, r)
    gw = b.mul(g, w)
    dx = b.mul(r, b.sub(gw, b.mul(n, b.mean(b.mul(gw, n), axes=last, keepdims=True))))
    return [dx, unbroadcast(b, b.mul(g, n), w.type)]


def _rms_norm_infer(types, a):
    out = _norm_infer("rms_norm", 1)(types, a)
    check_attr("rms_norm", types, a)
    return out


register(OpDef("rms_norm", "composite", _rms_norm_infer, _rms_norm_ref,
               num_operands=2, attrs={"eps": 1e-6, "kernel": "generic"},
               decompose=_rms_norm_decompose, vjp=_rms_norm_vjp,
               doc="x / sqrt(mean(x^2) + eps) * weight over the last dim"))


# -- pad -------------------------------------------------------------------------------------
def _pad_widths(t, a):
    """The (before, after) pairs of pad's `widths`, one per axis, checked."""
    w = a["widths"]
    ok = isinstance(w, (list, tuple)) and len(w) == t.rank and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and
        all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 0 for n in p)
        for p in w)
    if not ok:
        raise TraceError(f"pad: widths must be {t.rank} pairs (before, after) of non-negative "
                         f"ints for a tensor of shape {fmt_shape(t.shape)}, got {w!r}")
    for ax, (d, p) in enumerate(zip(t.shape, w)):
        if not is_static(d) and tuple(p) != (0, 0):
            raise TraceError(f"pad: axis {ax} of {fmt_shape(t.shape)} has the symbolic size {d} "
                             f"and cannot be padded (got {tuple(p)})")
    return [(int(b), int(e)) for b, e in w]


def _pad_infer(types, a):
    (t,) = types
    w = _pad_widths(t, a)
    return [t.with_shape(tuple(d + b + e if is_static(d) else d for d, (b, e) in zip(t.shape, w)))]


def _pad_decompose(b, operands, a):
    """pad is `unslice` (zeros of the padded shape with x at [before, before + n)); its
    gradient is therefore unslice's, the slice of the cotangent."""
    (x,) = operands
    w = _pad_widths(x.type, a)
    shape = [dim_to_attr(d + lo + hi) if is_static(d) else dim_to_attr(d)
             for d, (lo, hi) in zip(x.type.shape, w)]
    stops = [lo + d if is_static(d) else SLICE_END for d, (lo, _) in zip(x.type.shape, w)]
    return [b.unslice(x, shape=shape, starts=[lo for lo, _ in w], stops=stops,
                      steps=[1] * x.type.rank)]


register(OpDef("pad", "composite", _pad_infer,
               lambda xs, a: [np.pad(xs[0], [tuple(p) for p in a["widths"]])],
               attrs={"widths": REQUIRED}, decompose=_pad_decompose,
               doc="zero padding: (before, after) elements on each axis (np.pad, constant 0)"))


# -- one_hot / cross_entropy ---------------------------------------------------------------
def _check_labels(t, opname):
    check_integer_ids(t, opname, "class ids")


def _one_hot_infer(types, a):
    (t,) = types
    _check_labels(t, "one_hot")
    c = a["num_classes"]
    if isinstance(c, bool) or not isinstance(c, int) or c < 1:
        raise TraceError(f"one_hot: num_classes must be a positive int, got {c!r}")
    if not is_float(a["dtype"]):
        raise TraceError(f"one_hot: dtype must be a float type, got {a['dtype']}")
    return [TensorType(tuple(t.shape) + (c,), a["dtype"])]


def _np_one_hot(idx, c, dtype):
    # Out-of-range ids (negative included) give an all-zero row, as jax.nn.one_hot.
    return (idx[..., None] == np.arange(c)).astype(dtype)


def _one_hot_decompose(b, operands, a):
    (idx,) = operands
    classes = b.constant(np.arange(a["num_classes"], dtype=numpy_dtype(idx.dtype)), name="classes")
    return [b.cast(b.eq(b.expand_dims(idx, axis=-1), classes), dtype=a["dtype"])]


register(OpDef("one_hot", "composite", _one_hot_infer,
               lambda xs, a: [_np_one_hot(xs[0], a["num_classes"], numpy_dtype(a["dtype"]))],
               attrs={"num_classes": REQUIRED, "dtype": "f32"}, decompose=_one_hot_decompose,
               differentiable=False, doc="indices -> [..., num_classes] 0/1 rows (zeros if out of range)"))


def _cross_entropy_infer(types, a):
    logits, labels = types
    _float_operand(logits, "cross_entropy")
    _check_labels(labels, "cross_entropy")
    ok = logits.rank >= 1 and labels.rank == logits.rank - 1 and all(
        same_dim(p, q) for p, q in zip(labels.shape, logits.shape[:-1]))
    if not ok:
        raise TraceError(f"cross_entropy: labels {fmt_shape(labels.shape)} must have the shape of the "
                         f"logits {fmt_shape(logits.shape)} without its last (class) dim")
    if not is_static(logits.shape[-1]):
        raise TraceError(f"cross_entropy: the class dim of the logits {fmt_shape(logits.shape)} must be static")
    return [TensorType(labels.shape, logits.dtype)]


def _cross_entropy_ref(xs, a):
    logits, labels = xs
    c = logits.shape[-1]
    bad = (labels < 0) | (labels >= c)
    if bad.any():       # eagerly an error; compiled, check_numerics reports it
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise TraceError(f"cross_entropy: label {int(labels[where])} at index {list(where)} is outside "
                         f"[0, {c})", hint=f"labels are class ids from 0 to {c - 1}")
    oh = _np_one_hot(labels, logits.shape[-1], logits.dtype)
    return [(_np_lse(logits, -1, keepdims=False) - np.sum(logits * oh, axis=-1)).astype(logits.dtype)]


def _one_hot_like(b, labels, logits):
    return b.one_hot(labels, num_classes=int(logits.shape[-1]), dtype=logits.dtype)


def _cross_entropy_decompose(b, operands, a):
    logits, labels = operands
    last = [logits.type.rank - 1]
    lse = b.squeeze(_lse(b, logits, last), axes=last)
    picked = b.sum(b.mul(logits, _one_hot_like(b, labels, logits)), axes=last)
    return [b.sub(lse, picked)]


def _cross_entropy_vjp(b, op, cts):
    logits, labels = op.operands
    g = b.expand_dims(cts[0], axis=-1)
    p = b.softmax(logits, axis=-1)
    return [b.mul(b.sub(p, _one_hot_like(b, labels, logits)), g), None]


register(OpDef("cross_entropy", "composite", _cross_entropy_infer, _cross_entropy_ref,
               num_operands=2, decompose=_cross_entropy_decompose, vjp=_cross_entropy_vjp,
               nondiff_operands=(1,),
               doc="per-example logsumexp(logits) - logits[label]; labels are integer class ids"))
