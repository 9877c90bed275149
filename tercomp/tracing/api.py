"""NumPy-named functions that work on traced tensors (and eagerly on arrays).

    tc.exp(x), tc.sum(x, axis=1, keepdims=True), tc.matmul(a, b) / a @ b, tc.where(c, a, b),
    tc.softmax(x, axis=-1), tc.layer_norm(x, w, b), tc.cross_entropy(logits, labels), ...
"""
from __future__ import annotations

import numpy as np

from ..errors import TraceError, TypeSpecError
from ..ir.types import dtype_name as _dtype_name
from ..ops.registry import REGISTRY, REQUIRED
from .conv_api import avg_pool, conv, conv_transpose, max_pool  # noqa: F401  (tc.conv, ...)
from .indexing import getitem as _getitem
from .tracer import METHODS, NUMPY_API, Tracer, apply, user_location
from .tracer import OPERATORS as _OPERATORS


def _rank(x):
    return x.ndim if isinstance(x, Tracer) else np.ndim(x)


def _axes(x, axis):
    r = _rank(x)
    if axis is None:
        return list(range(r))
    axes = [axis] if isinstance(axis, int) else list(axis)
    out = []
    for a in axes:
        if not -r <= a < r:
            raise TraceError(f"axis {a} is out of range for a tensor of rank {r}", loc=user_location())
        out.append(a % r)
    return sorted(out)


def _axis(x, axis):
    return _axes(x, axis)[0]


# -- elementwise -------------------------------------------------------------------------
#: NumPy's names for the elementwise ops whose names differ from NumPy's (every other
#: elementwise registry op of one or two operands and no required attribute is tc.<op>)
NUMPY_NAMES = {"neg": ("negative",), "abs": ("abs", "absolute"), "sub": ("subtract",),
               "mul": ("multiply",), "div": ("divide",), "lt": ("less",), "le": ("less_equal",),
               "gt": ("greater",), "ge": ("greater_equal",), "eq": ("equal",),
               "ne": ("not_equal",)}


def _elementwise(opname, arity):
    def f(*xs):
        return apply(opname, *xs)
    f.__doc__ = f"Elementwise {opname} (tern.{opname}) of {arity} operand{'s' * (arity > 1)}."
    return f


def _define_elementwise():
    """tc.exp, tc.add, ...: one function per elementwise op of the registry, generated so
    that adding such an op to ops/elementwise.py adds its function too."""
    for name, d in REGISTRY.items():
        if d.family != "elementwise" or d.num_operands not in (1, 2) or \
                any(v is REQUIRED for v in d.attrs.values()):
            continue            # pow and cast take attributes; where has its own below
        for alias in NUMPY_NAMES.get(name, (name,)):
            f = _elementwise(name, d.num_operands)
            f.__name__ = f.__qualname__ = alias
            f.__module__ = __name__
            globals()[alias] = f


_define_elementwise()
stop_gradient = _elementwise("stop_gradient", 1)
stop_gradient.__name__ = "stop_gradient"


def where(cond, a, b): return apply("where", cond, a, b)


def square(x):
    return apply("mul", x, x)


def power(x, p):
    """x ** p for a scalar p (tern.pow); p == 2 becomes x * x."""
    if isinstance(p, Tracer) or np.ndim(p) != 0:
        raise TraceError("tc.power takes a scalar exponent", loc=user_location(),
                         hint="for a tensor exponent use tc.exp(p * tc.log(x))")
    if p == 1:
        return x
    if p == 2:
        return apply("mul", x, x)
    return apply("pow", x, exponent=float(p))


def clip(x, lo, hi):
    return minimum(maximum(x, lo), hi)


def astype(x, dtype):
    try:
        dtype = _dtype_name(dtype)
    except TypeSpecError as e:
        raise TypeSpecError(e.message, loc=user_location()) from None
    return apply("cast", x, dtype=dtype)


cast = astype


# -- reductions --------------------------------------------------------------------------
def sum(x, axis=None, keepdims=False):
    return apply("sum", x, axes=_axes(x, axis), keepdims=keepdims)


def mean(x, axis=None, keepdims=False):
    return apply("mean", x, axes=_axes(x, axis), keepdims=keepdims)


def max(x, axis=None, keepdims=False):
    return apply("max", x, axes=_axes(x, axis), keepdims=keepdims)


def min(x, axis=None, keepdims=False):
    return apply("min", x, axes=_axes(x, axis), keepdims=keepdims)


def argmax(x, axis=-1, keepdims=False):
    return apply("argmax", x, axis=_axis(x, axis), keepdims=keepdims)


def var(x, axis=None, keepdims=False):
    m = mean(x, axis, keepdims=True)
    return mean(square(x - m), axis, keepdims=keepdims)


# -- linear algebra ----------------------------------------------------------------------
def matmul(a, b, transpose_b=False):
    """NumPy matmul (batch dims broadcast; 1-D operands are promoted and squeezed)."""
    ra, rb = _rank(a), _rank(b)
    if ra == 0 or rb == 0:
        raise TraceError("matmul does not take scalars", loc=user_location(), hint="use * instead")
    if ra == 1:
        a = expand_dims(a, 0)
    if rb == 1:
        b = expand_dims(b, 0 if transpose_b else 1)
    out = apply("matmul", a, b, transpose_b=bool(transpose_b))
    if ra == 1:
        out = squeeze(out, -2)
    if rb == 1:
        out = squeeze(out, -1)
    return out


dot = matmul


# -- shapes ------------------------------------------------------------------------------
def _dim_attr(d):
    return d if isinstance(d, (int, np.integer)) and not isinstance(d, bool) else str(d)


def reshape(x, *shape):
    """Reshape; one dim may be -1. Symbolic dims are allowed (`x.reshape(x.shape[0], -1)`)."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    return apply("reshape", x, shape=[_dim_attr(d) for d in shape])


def transpose(x, axes=None):
    r = _rank(x)
    perm = list(range(r))[::-1] if axes is None else [a % r for a in axes]
    return apply("transpose", x, perm=perm)


def swapaxes(x, a, b):
    r = _rank(x)
    perm = list(range(r))
    perm[a % r], perm[b % r] = perm[b % r], perm[a % r]
    return apply("transpose", x, perm=perm)


def broadcast_to(x, shape):
    return apply("broadcast_to", x, shape=[_dim_attr(d) for d in shape])


def pad(x, pad_width, mode="constant", constant_values=0):
    """np.pad with zeros (tern.pad): `pad_width` is an int, a (before, after) pair for
    every axis, or one pair per axis."""
    if mode != "constant" or constant_values != 0:
        raise TraceError(f"tc.pad pads with zeros only, got mode={mode!r}, "
                         f"constant_values={constant_values!r}", loc=user_location(),
                         hint="add the constant afterwards: tc.pad(x - c, w) + c")
    r = _rank(x)
    try:
        w = np.broadcast_to(np.asarray(pad_width, dtype=object), (r, 2)).tolist() \
            if np.ndim(pad_width) <= 1 or np.shape(pad_width) == (1, 2) else pad_width
        w = [list(pair) for pair in w]
    except (ValueError, TypeError):
        raise TraceError(f"tc.pad: pad_width {pad_width!r} is not an int, a (before, after) "
                         f"pair or {r} such pairs", loc=user_location()) from None
    return apply("pad", x, widths=w)


def expand_dims(x, axis):
    r = _rank(x) + 1
    return apply("expand_dims", x, axis=axis % r)


def squeeze(x, axis=None):
    shape = x.shape if isinstance(x, Tracer) else np.shape(x)
    axes = [i for i, d in enumerate(shape) if d == 1] if axis is None else _axes(x, axis)
    return apply("squeeze", x, axes=axes)


def concatenate(xs, axis=0):
    xs = list(xs)
    return apply("concatenate", *xs, axis=_axis(xs[0], axis))


def stack(xs, axis=0):
    xs = [expand_dims(x, axis) for x in xs]
    return concatenate(xs, axis)


def take(x, indices, axis=0):
    """Gather `indices` (an integer tensor) along `axis`: embedding lookup."""
    return apply("take", x, indices, axis=_axis(x, axis))


# -- composites --------------------------------------------------------------------------
def softmax(x, axis=-1):
    return apply("softmax", x, axis=_axis(x, axis))


def log_softmax(x, axis=-1):
    return apply("log_softmax", x, axis=_axis(x, axis))


def logsumexp(x, axis=None, keepdims=False):
    return apply("logsumexp", x, axes=_axes(x, axis), keepdims=keepdims)


def layer_norm(x, weight, bias, eps=1e-5):
    return apply("layer_norm", x, weight, bias, eps=float(eps))


def rms_norm(x, weight, eps=1e-6):
    return apply("rms_norm", x, weight, eps=float(eps))


def one_hot(indices, num_classes):
    return apply("one_hot", indices, num_classes=int(num_classes))


def cross_entropy(logits, labels, reduction="mean"):
    """Softmax cross-entropy with integer labels; reduction 'mean', 'sum' or 'none'."""
    per = apply("cross_entropy", logits, labels)
    if reduction == "none":
        return per
    if reduction == "sum":
        return sum(per)
    if reduction == "mean":
        return mean(per)
    raise TraceError(f"unknown reduction {reduction!r}", loc=user_location(),
                     hint="use 'mean', 'sum' or 'none'")


def _define_methods():
    """x.sum(), x.reshape(...), x.astype(...): the registry ops that declare a method
    (OpDef.method) have it, as the tc function of that name; then the methods that are
    not one op. Adding an op with a method form touches only its family file."""
    for d in REGISTRY.values():
        if d.method is not None:
            METHODS[d.method] = globals()[d.method]
    METHODS.update(swapaxes=swapaxes, var=var, clip=clip)


_define_methods()
_OPERATORS.update(pow=power, matmul=matmul, transpose=transpose, getitem=_getitem)

# np.<name>(traced) dispatches to these (see tracer.NUMPY_API)
NUMPY_API.update({k: v for k, v in list(globals().items())
                  if callable(v) and not k.startswith("_") and getattr(v, "__module__", None) == __name__})
NUMPY_API.update(true_divide=divide, amax=max, amin=min)
# metadata, not computation: getattr(x, "shape", np.shape(x)) evaluates np.shape eagerly
NUMPY_API.update(shape=lambda x: tuple(x.shape), ndim=lambda x: x.ndim)
