"""Structured control flow: tc.scan and tc.checkpoint, traced into ops with a body, and
tc.associative_scan, traced in log depth.

A Python loop over a traced sequence unrolls into the IR (its size grows with the
length); `tc.scan` traces the step function once into the body of one `tern.scan` op,
so one compiled module serves every length when the length is symbolic.
"""
from __future__ import annotations

import functools

import numpy as np

from ..errors import TraceError
from ..ir import Graph, as_dim, is_static
from ..ops import interpret
from ..ops.shape_util import fmt_shape, same_dim
from .. import pytree
from . import api as _api
from .trace import trace as trace_fn
from .tracer import BodyTrace, Tracer, current_trace, user_location


def _fmt(t) -> str:
    return f"{fmt_shape(t.shape)}{t.dtype}"


def _to_value(tr, x, loc):
    """A leaf as a Value of trace `tr`: its own, captured from an enclosing trace, or a
    constant made from an array or Python number."""
    if isinstance(x, Tracer):
        if x.trace is tr:
            return x.value
        if isinstance(tr, BodyTrace):
            return tr.capture(x)
        raise TraceError(f"value %{x.name} belongs to another trace", loc=loc)
    arr = np.asarray(x, dtype=np.float32) if isinstance(x, float) else np.asarray(x)
    if arr.dtype == object:
        raise TraceError(f"expected an array, got {type(x).__name__}", loc=loc)
    return tr.const(arr, name="cst", loc=loc)


def _eager(fn, *args):
    """Run `fn` on arrays by tracing it and running the reference interpreter. NumPy
    scalars stay arrays of their dtype (np.float64 is a Python float, which tracing
    would take as float32)."""
    leaves, _, tree = pytree.flatten(tuple(args))
    args = pytree.unflatten(tree, [np.asarray(x) if isinstance(x, np.generic) else x for x in leaves])
    g = trace_fn(fn, *args, name="eager")
    leaves = pytree.flatten(tuple(args))[0]
    return pytree.unflatten(g.meta["out_tree"], interpret(g, *[np.asarray(x) for x in leaves]))


def _trace_body(tr, name, fn, in_values, in_tree, loc, in_names):
    """Trace fn(*unflatten(in_tree, body inputs)) into a body Graph nested in trace `tr`.
    Returns (body, outputs pytree of Values, captured outer Values)."""
    body = Graph(name=f"{tr.graph.name}.{name}", _names=tr.graph._names)
    bt = BodyTrace(body, tr)
    with bt:
        ins = [Tracer(body.add_input(n, t), bt) for n, t in zip(in_names, in_values)]
        out = fn(*pytree.unflatten(in_tree, ins))
        leaves, paths, out_tree = pytree.flatten(out)
        outs = [_to_value(bt, x, loc) for x in leaves]
    body.set_outputs(outs, [p or "out" for p in paths])
    captured = [outer for outer, _ in bt.captured.values()]
    return body, out_tree, captured


def scan(f, init, xs=None, length=None, reverse=False):
    """Loop `f(carry, x) -> (carry, y)` over the leading axis of `xs`, as jax.lax.scan:
    returns `(final carry, ys)` with the ys of every step stacked along a new axis 0.
    `init`, `xs`, the carry and `y` are pytrees of arrays; the carry must keep its
    shapes and dtypes. `length` is required without `xs` (an int or a dim name). With
    `reverse=True` the steps run from the last index to the first (ys stay in place).

    >>> def step(h, x):
    ...     h = tc.tanh(h @ W + x)
    ...     return h, h
    >>> h_last, hs = tc.scan(step, h0, xs)          # xs: [T, B, H], one tern.scan op
    """
    loc = user_location()
    if current_trace() is None:
        return _eager(lambda i, x: scan(f, i, x, length, reverse), init, xs)
    tr = current_trace()
    if not callable(f):
        raise TraceError(f"tc.scan: f must be a function f(carry, x) -> (carry, y), got "
                         f"{type(f).__name__}", loc=loc)
    c_leaves, c_paths, c_tree = pytree.flatten(init)
    x_leaves, x_paths, x_tree = pytree.flatten(xs)
    carries = [_to_value(tr, x, loc) for x in c_leaves]
    seqs = [_to_value(tr, x, loc) for x in x_leaves]
    n = _scan_length(seqs, x_paths, length, loc)
    body_in = [v.type for v in carries] + [v.type.with_shape(v.type.shape[1:]) for v in seqs]
    names = [f"carry.{p}" if p else "carry" for p in c_paths] + [f"x.{p}" if p else "x" for p in x_paths]

    def step(carry, x):
        out = f(carry, x)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TraceError("tc.scan: f must return a pair (new carry, y)", loc=loc,
                             hint="return (carry, None) when there is no per-step output")
        return tuple(out)

    body, out_tree, captured = _trace_body(tr, "scan", step, body_in, ["tuple", [c_tree, x_tree]],
                                           loc, names)
    new_c_tree, y_tree = out_tree[1]
    if pytree.jsonable(new_c_tree) != pytree.jsonable(c_tree):
        raise TraceError(f"tc.scan: f returns a carry with structure {pytree.jsonable(new_c_tree)}, "
                         f"but init has {pytree.jsonable(c_tree)}", loc=loc)
    for p, v, w in zip(c_paths, carries, body.outputs):
        if v.type.dtype != w.type.dtype or len(v.shape) != len(w.shape) or not all(
                same_dim(a, b) for a, b in zip(v.shape, w.shape)):
            raise TraceError(f"tc.scan: f turns the carry{' ' + p if p else ''} from {_fmt(v.type)} "
                             f"into {_fmt(w.type)}; a carry must keep its shape and dtype", loc=loc,
                             hint="cast or reshape the new carry to the type of init")
    attrs = {"body": body, "n_carry": len(carries), "n_xs": len(seqs),
             "length": int(n) if is_static(n) else str(n), "reverse": bool(reverse)}
    res = tr.emit("scan", carries + seqs + captured, attrs, name="scan", loc=loc)
    res = list(res) if isinstance(res, tuple) else [res]
    n_c = len(carries)
    return pytree.unflatten(new_c_tree, res[:n_c]), pytree.unflatten(y_tree, res[n_c:])


def _scan_length(seqs, paths, length, loc):
    n = None
    for p, v in zip(paths, seqs):
        if v.type.rank == 0:
            raise TraceError(f"tc.scan: xs{' ' + p if p else ''} is a scalar; every leaf of xs "
                             "needs a leading axis to scan over", loc=loc)
        d = v.shape[0]
        if n is None:
            n, first = d, p
        elif not same_dim(n, d):
            raise TraceError(f"tc.scan: the leaves of xs have different leading dims: "
                             f"{first or 'xs'} has {n}, {p or 'xs'} has {d}", loc=loc,
                             hint="every leaf of xs is scanned along axis 0 and needs the same length")
    if length is not None:
        if isinstance(length, bool) or not isinstance(length, (int, np.integer, str)):
            raise TraceError(f"tc.scan: length must be an int or a dim name, got {length!r}", loc=loc)
        given = as_dim(int(length) if isinstance(length, np.integer) else length)
        if n is not None and not same_dim(n, given):
            raise TraceError(f"tc.scan: length={length} but xs has leading dim {n}", loc=loc)
        if is_static(given) and given < 0:
            raise TraceError(f"tc.scan: length {length} is negative", loc=loc)
        n = given
    if n is None:
        raise TraceError("tc.scan: give xs or a length", loc=loc,
                         hint="tc.scan(f, init, None, length=T)")
    return n


def checkpoint(f):
    """`tc.checkpoint(f)` behaves as `f`, but the backward recomputes f's intermediates
    from its inputs instead of keeping them (jax.checkpoint): less memory, more compute.
    `tc.scan(tc.checkpoint(step), ...)` keeps only the carries of each step.

    >>> step = tc.checkpoint(lambda h, x: (tc.tanh(h @ W + x),) * 2)
    """
    @functools.wraps(f)
    def wrapped(*args):
        loc = user_location()
        tr = current_trace()
        if tr is None:
            return f(*args)
        leaves, paths, tree = pytree.flatten(tuple(args))
        vals = [_to_value(tr, x, loc) for x in leaves]
        body, out_tree, captured = _trace_body(tr, "checkpoint", f, [v.type for v in vals], tree, loc,
                                               [f"arg.{p}" for p in paths])
        res = tr.emit("checkpoint", vals + captured, {"body": body}, name="remat", loc=loc)
        res = list(res) if isinstance(res, tuple) else [res]
        return pytree.unflatten(out_tree, res)
    return wrapped


def associative_scan(fn, elems, reverse=False, axis=0):
    """Inclusive scan with an associative `fn(a, b)` over `axis` of the pytree `elems`, as
    jax.lax.associative_scan: out[i] = fn(...fn(fn(e[0], e[1]), e[2])..., e[i]). `fn`
    works on whole slices (pytrees shaped like elems with any length along `axis`) and
    must keep their shapes and dtypes. Traced in log depth (about 2 log2(n) levels of
    `fn`) for a static length; a symbolic length is refused: use tc.scan.

    >>> tc.associative_scan(lambda a, b: a + b, x)            # cumulative sum along axis 0
    """
    loc = user_location()
    if current_trace() is None:
        return _eager(lambda e: associative_scan(fn, e, reverse, axis), elems)
    leaves, paths, tree = pytree.flatten(elems)
    if not leaves:
        raise TraceError("tc.associative_scan: elems has no arrays", loc=loc)
    tr = current_trace()
    xs = [Tracer(_to_value(tr, x, loc), tr) for x in leaves]
    for p, x in zip(paths, xs):
        if not -x.ndim <= axis < max(x.ndim, 1) or x.ndim == 0:
            raise TraceError(f"tc.associative_scan: axis {axis} is out of range for elems"
                             f"{' ' + p if p else ''} of shape {fmt_shape(x.shape)}", loc=loc)
    ax = [axis % x.ndim for x in xs]
    n = xs[0].shape[ax[0]]
    for p, x, a in zip(paths, xs, ax):
        if not is_static(x.shape[a]):
            raise TraceError(f"tc.associative_scan: the scanned axis of elems{' ' + p if p else ''} "
                             f"has the symbolic size {x.shape[a]}; the log-depth form needs a "
                             "static length", loc=loc,
                             hint="use tc.scan for a symbolic length (a sequential loop)")
        if x.shape[a] != n:
            raise TraceError(f"tc.associative_scan: the leaves of elems have different lengths "
                             f"along axis {axis}: {n} and {x.shape[a]}", loc=loc)
    # work on axis 0, in forward order
    xs = [_move(x, a, 0) for x, a in zip(xs, ax)]
    if reverse:
        xs = [_flip(x) for x in xs]

    def combine(a, b):
        out = fn(pytree.unflatten(tree, a), pytree.unflatten(tree, b))
        got, _, got_tree = pytree.flatten(out)
        if pytree.jsonable(got_tree) != pytree.jsonable(tree):
            raise TraceError(f"tc.associative_scan: fn returns the structure "
                             f"{pytree.jsonable(got_tree)}, elems has {pytree.jsonable(tree)}", loc=loc)
        for p, g, x in zip(paths, got, a):
            if not isinstance(g, Tracer) or tuple(g.shape) != tuple(x.shape) or g.dtype != x.dtype:
                shape = fmt_shape(g.shape if hasattr(g, "shape") else np.shape(g))
                raise TraceError(f"tc.associative_scan: fn turns{' ' + p if p else ''} "
                                 f"{fmt_shape(x.shape)}{x.dtype} into {shape}{getattr(g, 'dtype', '')}; "
                                 "fn must keep the shapes and dtypes of its operands", loc=loc)
        return got

    out = _assoc(combine, xs)
    if reverse:
        out = [_flip(x) for x in out]
    out = [_move(x, 0, a) for x, a in zip(out, ax)]
    return pytree.unflatten(tree, out)


def _assoc(combine, xs):
    """The odd/even recursion of Blelloch's scan (as jax.lax.associative_scan)."""
    n = xs[0].shape[0]
    if n < 2:
        return xs
    odd = _assoc(combine, combine([x[0:n - 1:2] for x in xs], [x[1::2] for x in xs]))
    rest = [x[2::2] for x in xs]
    if n > 2:
        left = [o[:-1] for o in odd] if n % 2 == 0 else odd
        even = [_api.concatenate([x[0:1], e], 0) for x, e in zip(xs, combine(left, rest))]
    else:
        even = [x[0:1] for x in xs]
    return [_interleave(e, o) for e, o in zip(even, odd)]


def _interleave(even, odd):
    """out[0::2] = even, out[1::2] = odd (len(even) is len(odd) or len(odd) + 1)."""
    k = odd.shape[0]
    pairs = _api.stack([even[:k], odd], 1)                    # [k, 2, ...]
    out = _api.reshape(pairs, (2 * k,) + tuple(odd.shape[1:]))
    return out if even.shape[0] == k else _api.concatenate([out, even[k:]], 0)


def _move(x, src, dst):
    if src == dst:
        return x
    perm = list(range(x.ndim))
    perm.insert(dst, perm.pop(src))
    return _api.transpose(x, perm)


def _flip(x):
    idx = np.arange(x.shape[0] - 1, -1, -1, dtype=np.int32)
    return _api.take(x, idx, 0)
