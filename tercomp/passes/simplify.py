"""simplify: constant folding, algebraic identities, CSE and DCE.

The identities are a table (opname -> patterns), applied by the shared rewrite driver.
"""
from __future__ import annotations

import hashlib
import math

import numpy as np

from ..errors import TercompError
from ..dtypes import numpy_dtype
from ..ir import Graph
from ..ir.types import is_static
from ..ops import get
from .manager import register_pass
from .rewrite import copy_op, dce, rewrite

FOLD_LIMIT = 1 << 20   # fold ops whose result has at most this many elements


def const_value(v):
    """The NumPy value of a constant op's result, or None."""
    p = v.producer
    if p is not None and p.opname == "constant" and isinstance(p.attrs.get("value"), np.ndarray):
        return p.attrs["value"]
    return None


def _is_splat(v, x) -> bool:
    c = const_value(v)
    return c is not None and c.size > 0 and c.dtype != np.bool_ and bool(np.all(c == x))


def _same_type(a, b):
    return a.type == b.type


def _identity(side_value, side):
    """x op c -> x when c is the splat `side_value` (on `side` 0 or 1) and types agree."""
    def pat(b, op, xs):
        c, x = (xs[0], xs[1]) if side == 0 else (xs[1], xs[0])
        if _is_splat(c, side_value) and x.type == op.results[0].type:
            return x
        return None
    return pat


def _involution(b, op, xs):
    p = xs[0].producer
    if p is not None and p.opname == op.opname:
        return p.operands[0]
    return None


def _transpose_transpose(b, op, xs):
    p = xs[0].producer
    perm = op.attrs["perm"]
    if perm == list(range(len(perm))):
        return xs[0]
    if p is not None and p.opname == "transpose":
        inner = p.attrs["perm"]
        composed = [inner[i] for i in perm]
        if composed == list(range(len(composed))):
            return p.operands[0]
        return b.emit("transpose", p.operands[0], perm=composed, name=op.results[0].name)
    return None


def _noop_if_same_type(b, op, xs):
    return xs[0] if xs[0].type == op.results[0].type else None


def _reshape_reshape(b, op, xs):
    if xs[0].type == op.results[0].type:
        return xs[0]
    p = xs[0].producer
    if p is not None and p.opname == "reshape":
        return b.emit("reshape", p.operands[0], shape=op.attrs["shape"], name=op.results[0].name)
    return None


def _static_size(b, op, xs):
    """size over static dims -> its constant (the mean's gradient divides by one)."""
    t = xs[0].type
    axes = range(t.rank) if op.attrs.get("axes") is None else op.attrs["axes"]
    dims = [t.shape[ax] for ax in axes]
    if not all(is_static(d) for d in dims):
        return None
    n = np.asarray(math.prod(int(d) for d in dims), dtype=numpy_dtype(op.results[0].type.dtype))
    return b.emit("constant", value=n, name=op.results[0].name)


def _simplify_body(b, op, xs):
    """Simplify the body of an op with a region (tern.scan, tern.checkpoint)."""
    attrs = dict(op.attrs)
    attrs["body"] = simplify(op.attrs["body"])
    new = b.graph.add_op(op.opname, xs, attrs, [r.type for r in op.results], op.loc,
                         names=[r.name for r in op.results])
    return new.results


PATTERNS = {
    "add": [_identity(0, 0), _identity(0, 1)],
    "sub": [_identity(0, 1)],
    "mul": [_identity(1, 0), _identity(1, 1)],
    "div": [_identity(1, 1)],
    "neg": [_involution],
    "transpose": [_transpose_transpose],
    "reshape": [_reshape_reshape],
    "cast": [_noop_if_same_type],
    "size": [_static_size],
    "broadcast_to": [_noop_if_same_type],
    "scan": [_simplify_body],
    "checkpoint": [_simplify_body],
}


def _fold(b, op, xs):
    opdef = get(op.opname)
    if not opdef.foldable or opdef.lower is None and opdef.decompose is None:
        return None
    vals = [const_value(v) for v in xs]
    if any(v is None for v in vals) or not op.results or len(op.results) != 1:
        return None
    t = op.results[0].type
    if not t.is_static or int(np.prod(t.shape)) > FOLD_LIMIT:
        return None
    try:
        out = opdef.reference(vals, op.attrs)[0]
    except (TercompError, ArithmeticError, ValueError):
        return None         # e.g. a cache row out of range: left for run time to meet
    return b.emit("constant", value=np.asarray(out), name=op.results[0].name)


#: arrays up to this many bytes are keyed by a digest of all their bytes; larger ones
#: by a sample (cse then compares the arrays themselves before merging two ops)
_DIGEST_ALL = 1 << 16


def _attr_key(v):
    if isinstance(v, Graph):
        return ("graph", id(v))
    if isinstance(v, np.ndarray):
        return ("array", v.dtype.str, v.shape, _fingerprint(v))
    if isinstance(v, list):
        return tuple(_attr_key(x) for x in v)
    return (type(v).__name__, v)


def _fingerprint(v: np.ndarray) -> str:
    """sha1 of a small array's bytes; of a large one's first and last 16 KiB and 4096
    elements spread over it (a model's weights are hundreds of MB: hashing them whole on
    every CSE took a second of a 700M compile)."""
    flat = np.ascontiguousarray(v).reshape(-1)
    if flat.nbytes <= _DIGEST_ALL:
        return hashlib.sha1(flat.tobytes()).hexdigest()
    raw = flat.view(np.uint8)
    h = hashlib.sha1(raw[:1 << 14].tobytes())
    h.update(raw[-(1 << 14):].tobytes())
    h.update(flat[::max(1, flat.size // 4096)].tobytes())
    return h.hexdigest()


def _same_attrs(a: dict, b: dict) -> bool:
    """Whether two ops' attributes whose keys match are equal (their arrays compared
    whole: a key holds a large array's sample only)."""
    for k, v in a.items():
        w = b[k]
        if isinstance(v, np.ndarray) and not np.array_equal(v, w):
            return False
        if isinstance(v, list) and any(isinstance(x, np.ndarray) and not np.array_equal(x, y)
                                       for x, y in zip(v, w)):
            return False
    return True


def cse(graph: Graph) -> Graph:
    seen = {}

    def on_op(b, op, xs):
        key = (op.opname, tuple(id(x) for x in xs), tuple(sorted((k, _attr_key(v)) for k, v in op.attrs.items())))
        for attrs, results in seen.get(key, ()):
            if _same_attrs(op.attrs, attrs):
                return results
        results = copy_op(b, op, xs)
        seen.setdefault(key, []).append((op.attrs, results))
        return results
    return rewrite(graph, {}, on_op=on_op)


@register_pass("simplify")
def simplify(graph: Graph, max_iters: int = 4) -> Graph:
    """Fold constants, apply the identity table, CSE, DCE; repeat to a fixed point."""
    patterns = {k: list(v) for k, v in PATTERNS.items()}
    patterns["*"] = [_fold]
    for _ in range(max_iters):
        before = len(graph.ops)
        graph = dce(cse(dce(rewrite(graph, patterns))))
        if len(graph.ops) == before:
            break
    return graph


@register_pass("cse")
def cse_pass(graph: Graph) -> Graph:
    return dce(cse(graph))


@register_pass("dce")
def dce_pass(graph: Graph) -> Graph:
    return dce(graph)
