"""tc.conv, tc.conv_transpose, tc.max_pool and tc.avg_pool: PyTorch's conventions
(x [N, C, *spatial], weights [O, C // groups, *kernel]) over the registry's conv ops
(tercomp/ops/conv.py). This module turns the user's spellings of the geometry (an int
for every spatial dim, one per dim, (lo, hi) pairs, "same" / "valid") into the ops'
explicit attributes; the ops' shape rules check the values.
"""
from __future__ import annotations

import numpy as np

from ..errors import TercompError, TraceError
from .tracer import apply, user_location

PADDING_HINT = ('padding is an int, one int per spatial dim, a (lo, hi) pair per spatial dim, '
                'or "same" / "valid"')


def _shape(x):
    return tuple(getattr(x, "shape", np.shape(x)))


def _spatial_rank(x, fn):
    r = len(_shape(x)) - 2
    if not 1 <= r <= 3:
        raise TraceError(f"{fn}: x of shape {list(_shape(x))} has rank {r + 2}; it must have rank "
                         f"3, 4 or 5", loc=user_location(),
                         hint="x is [N, C, *spatial] with 1, 2 or 3 spatial dims (PyTorch's layout)")
    return r


def _per_dim(v, nd, name, fn):
    """An int or one int per spatial dim -> a list of nd ints."""
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        return [int(v)] * nd
    if isinstance(v, (list, tuple)) and len(v) == nd and \
            all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in v):
        return [int(i) for i in v]
    raise TraceError(f"{fn}: {name} must be an int or {nd} ints (one per spatial dim), got {v!r}",
                     loc=user_location())


def resolve_padding(padding, nd, fn, same=None):
    """(lo, hi) pairs per spatial dim from the user's `padding`: an int, one int per dim,
    (lo, hi) pairs, "valid", or "same" where `same` = (kernel, input size, stride,
    dilation) is given, which pads so that the output has ceil(in / stride) positions,
    the extra element (an even kernel) after, as PyTorch and JAX do. `fn` names the
    caller in errors (nn layers use it too)."""
    if isinstance(padding, str):
        if padding == "valid":
            return [[0, 0] for _ in range(nd)]
        if padding == "same" and same is not None:
            kernel, in_size, stride, dilation = same
            if len(kernel) != nd:           # w's rank is wrong: the op's shape rule says so
                return [[0, 0] for _ in range(nd)]
            pairs = []
            for x, k, s, d in zip(in_size, kernel, stride, dilation):
                # with stride 1 the total is d * (k - 1) for any size (a symbolic one too)
                total = d * (k - 1) if s == 1 else \
                    max((-(-int(x) // s) - 1) * s + d * (k - 1) + 1 - int(x), 0)
                pairs.append([total // 2, total - total // 2])
            return pairs
        allowed = '"same" or "valid"' if same is not None else '"valid"'
        raise TraceError(f"{fn}: padding must be {allowed} when it is a string, got {padding!r}",
                         loc=user_location(), hint=PADDING_HINT)
    if isinstance(padding, (list, tuple)) and len(padding) == nd and \
            all(isinstance(p, (list, tuple)) for p in padding):
        if all(len(p) == 2 for p in padding):
            return [list(p) for p in padding]
    else:
        try:
            return [[p, p] for p in _per_dim(padding, nd, "padding", fn)]
        except TraceError:
            pass
    raise TraceError(f"{fn}: cannot read padding={padding!r} for {nd} spatial dim"
                     f"{'s' * (nd > 1)}", loc=user_location(), hint=PADDING_HINT)


def _apply(opname, *args, **attrs):
    """apply(), with the user's line on a shape rule's error also when no argument is
    traced (the NumPy reference runs eagerly then, and checks the same rules)."""
    try:
        return apply(opname, *args, **attrs)
    except TercompError as e:
        if e.loc is None:
            raise type(e)(e.message, loc=user_location(), hint=e.hint) from None
        raise


def conv(x, w, stride=1, padding=0, dilation=1, groups=1):
    """N-d convolution (cross-correlation, as PyTorch's conv1d/2d/3d) of x [N, C, *S]
    with weights w [O, C // groups, *K]; the rank of x picks 1-D, 2-D or 3-D.

    `stride`, `dilation`: an int or one per spatial dim. `padding`: an int, one int per
    spatial dim, a (lo, hi) pair per spatial dim, "valid" (none) or "same" (the output
    has ceil(S / stride) positions). `groups`: grouped (and, with groups == C,
    depthwise) convolution. The batch dim may be symbolic.

    >>> tc.conv(np.ones((1, 1, 5), np.float32), np.ones((1, 1, 3), np.float32), padding=1)
    array([[[2., 3., 3., 3., 2.]]], dtype=float32)
    """
    nd = _spatial_rank(x, "conv")
    stride, dilation = _per_dim(stride, nd, "stride", "conv"), _per_dim(dilation, nd, "dilation", "conv")
    pads = resolve_padding(padding, nd, "conv", same=(_shape(w)[2:], _shape(x)[2:], stride, dilation))
    return _apply("conv", x, w, stride=stride, padding=pads, dilation=dilation, groups=groups)


def conv_transpose(x, w, stride=1, padding=0, output_padding=0, dilation=1, groups=1):
    """The transposed convolution (PyTorch's conv_transpose1d/2d/3d): the gradient of
    `conv` with respect to its input. x [N, C_in, *S], w [C_in, C_out // groups, *K]
    (PyTorch's layout for it); the output has (S - 1) * stride - lo - hi +
    dilation * (K - 1) + 1 + output_padding positions per spatial dim.

    >>> tc.conv_transpose(np.ones((1, 1, 2), np.float32), np.ones((1, 1, 3), np.float32), stride=2)
    array([[[1., 1., 2., 1., 1.]]], dtype=float32)
    """
    nd = _spatial_rank(x, "conv_transpose")
    return _apply("conv_transpose", x, w, stride=_per_dim(stride, nd, "stride", "conv_transpose"),
                  padding=resolve_padding(padding, nd, "conv_transpose"),
                  output_padding=_per_dim(output_padding, nd, "output_padding", "conv_transpose"),
                  dilation=_per_dim(dilation, nd, "dilation", "conv_transpose"), groups=groups)


def _pool(opname, x, window, stride, padding):
    nd = _spatial_rank(x, opname)
    window = _per_dim(window, nd, "window", opname)
    stride = window if stride is None else _per_dim(stride, nd, "stride", opname)
    return _apply(opname, x, window=window, stride=stride, padding=resolve_padding(padding, nd, opname))


def max_pool(x, window, stride=None, padding=0):
    """Max over windows of x [N, C, *S] (PyTorch's max_pool1d/2d/3d: stride defaults to
    the window, padding is -inf and at most half the window). Its gradient goes to the
    first maximum of each window.

    >>> tc.max_pool(np.arange(8, dtype=np.float32).reshape(1, 1, 8), 2)
    array([[[1., 3., 5., 7.]]], dtype=float32)
    """
    return _pool("max_pool", x, window, stride, padding)


def avg_pool(x, window, stride=None, padding=0):
    """Mean over windows of x [N, C, *S] (PyTorch's avg_pool1d/2d/3d with its defaults:
    stride = window, zero padding counted in the mean). Global average pooling is
    `tc.mean(x, axis=(2, 3))`.

    >>> tc.avg_pool(np.arange(8, dtype=np.float32).reshape(1, 1, 8), 2)
    array([[[0.5, 2.5, 4.5, 6.5]]], dtype=float32)
    """
    return _pool("avg_pool", x, window, stride, padding)
