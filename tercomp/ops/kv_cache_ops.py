"""KV-cache ops: the pieces of attention over a cache that a language model's prefill and
decode steps share (see tercomp/generate.py).

The ops are pure: a cache is an ordinary tensor operand and `cache_write` returns the
updated cache. The generation driver binds a step's cache inputs and outputs to mutable
`util.global`s (tercomp/lowering/state.py), and IREE then updates the global in place.

- `arange(like, start)`: `start + [0, 1, ..., n-1]` as i32, n = like.shape[0] (a
  symbolic n is fine): the positions of a run of tokens.
- `cache_write(cache [S, ...], rows [T, ...], start)`: the cache with rows
  start..start+T-1 replaced by `rows` (XLA's dynamic_update_slice along axis 0).
- `cached_attention(q [T, H, D], k [S, KV, D], v [S, KV, D], start) {scale, window, kernel}`:
  causal softmax attention of the T queries at absolute positions start..start+T-1 over
  the cache rows 0..start+T-1 (query t sees rows 0..start+t; with `window` W, a sliding
  window layer's, only the W most recent of them, rows start+t-W+1..start+t). H must be a multiple of KV
  (grouped-query attention: query head h reads kv head h // (H / KV)). Only those
  start+T rows are read, so a decode step costs O(position), not O(S). `kernel` "cpu"
  (a module for llvm-cpu only; where it fits: D % 8 == 0, D <= 512, an f16 or f32
  cache) is the hand-written dispatch of kernels/attention/attention_cpu.py for every T;
  "generic" (default) is linalg (its decode form for T <= DECODE_MAX_T).

- `rope(x [T, H, D], cos [T, D/2], sin [T, D/2]) {style, kernel}`: the rotary position
  embedding of T rows by their angles' tables; "neox" rotates the pairs (i, i + D/2),
  "interleaved" the pairs (2i, 2i + 1). A composite (slices, products, a concatenate);
  `kernel` "cpu" is the row kernel of kernels/rows/rows_cpu.py (where it fits: "neox"
  pairs of one sequence, f32, D % 16 == 0).

The lowerings here are the generic ones: a `kernel` other than "generic" names a row of
the kernel table (kernels/table.py), which the op's shape rule checks it fits and which
emits the op instead.

`start` is an i32 scalar (rank 0). Writing or reading past row S is undefined in the
compiled code (the NumPy reference raises): callers check bounds before the call.
None of the ops is differentiable (they serve inference).
"""
from __future__ import annotations

import numpy as np

from iree.compiler import ir
from iree.compiler.dialects import arith, linalg, math, scf, tensor

from ..kernels.table import check_attr
from ..codegen.builders import (PARALLEL, REDUCTION, affine_map, elem_type, index_const,
                                scalar_const, scalar_index, value_dim)
from ..errors import TraceError
from ..ir import TensorType, is_static
from ..ir.types import is_float
from .registry import OpDef, REQUIRED, register
from .shape_util import SLICE_END, reshape_value, same_dim


def _fmt(t: TensorType) -> str:
    return f"[{', '.join(str(d) for d in t.shape)}] {t.dtype}"


def _check_start(t: TensorType, opname: str):
    if t.rank != 0 or t.dtype != "i32":
        raise TraceError(f"{opname}: start must be an i32 scalar (rank 0), got {_fmt(t)}",
                         hint="pass the position as np.int32 / tc.spec((), 'int32')")


def _slice_args(offsets, sizes):
    """(dynamic offsets, dynamic sizes, dynamic strides, static ...) for tensor slice ops:
    ints are static, MLIR values dynamic."""
    dyn = ir.ShapedType.get_dynamic_size()
    static_off = [o if isinstance(o, int) else dyn for o in offsets]
    static_size = [s if isinstance(s, int) else dyn for s in sizes]
    return ([o for o in offsets if not isinstance(o, int)],
            [s for s in sizes if not isinstance(s, int)], [],
            static_off, static_size, [1] * len(offsets))


# -- arange ------------------------------------------------------------------------------
def _arange_infer(types, a):
    like, start = types
    _check_start(start, "arange")
    if like.rank < 1:
        raise TraceError(f"arange: the shape operand must have rank >= 1, got {_fmt(like)}")
    return [TensorType((like.shape[0],), "i32")]


def _arange_ref(xs, a):
    like, start = xs
    return [(np.int32(start) + np.arange(like.shape[0], dtype=np.int32)).astype(np.int32)]


def _arange_lower(ctx, op, xs):
    i32 = ir.IntegerType.get_signless(32)
    start = xs[1]
    out_t = op.results[0].type

    def body(s, _acc):
        i = arith.IndexCastOp(i32, linalg.IndexOp(0).result).result
        return arith.AddIOp(s, i).result
    scalar_map = ir.AffineMap.get(1, 0, [])
    return [ctx.generic([start], [scalar_map], out_t, ir.AffineMap.get_identity(1),
                        [PARALLEL], body, init=_empty_like_dim(ctx, xs[0], out_t))]


def _empty_like_dim(ctx, like, out_t):
    if is_static(out_t.shape[0]):
        return tensor.EmptyOp([out_t.shape[0]], elem_type(out_t.dtype)).result
    return tensor.EmptyOp([value_dim(like, 0)], elem_type(out_t.dtype)).result


register(OpDef("arange", "cache", _arange_infer, _arange_ref, num_operands=2,
               lower=_arange_lower, differentiable=False, nondiff_operands=(0, 1),
               doc="start + [0, ..., n-1] (i32) with n = like.shape[0]: token positions"))


# -- cache_write -------------------------------------------------------------------------
def _cache_write_infer(types, a):
    cache, rows, start = types
    _check_start(start, "cache_write")
    if rows.rank != cache.rank or rows.rank < 1 or rows.dtype != cache.dtype or \
            any(p != q for p, q in zip(rows.shape[1:], cache.shape[1:])):
        raise TraceError(f"cache_write: rows {_fmt(rows)} do not fit the cache {_fmt(cache)}",
                         hint="rows must have the cache's dtype and trailing dims; cast them "
                              "with .astype(cache dtype)")
    if not is_static(cache.shape[0]):
        raise TraceError(f"cache_write: the cache {_fmt(cache)} needs a static length")
    return [cache]


def _cache_write_ref(xs, a):
    cache, rows, start = xs
    s, t = int(start), rows.shape[0]
    if s < 0 or s + t > cache.shape[0]:
        raise TraceError(f"cache_write: rows {s}..{s + t - 1} are outside the cache of "
                         f"{cache.shape[0]} rows")
    out = cache.copy()
    out[s:s + t] = rows
    return [out]


def _cache_write_lower(ctx, op, xs):
    cache, rows, start = xs
    rank = op.operands[0].type.rank
    offsets = [scalar_index(start)] + [0] * (rank - 1)
    sizes = [d if is_static(d) else value_dim(rows, i) for i, d in enumerate(op.operands[1].type.shape)]
    return [tensor.InsertSliceOp(rows, cache, *_slice_args(offsets, sizes)).result]


register(OpDef("cache_write", "cache", _cache_write_infer, _cache_write_ref, num_operands=3,
               lower=_cache_write_lower, differentiable=False, nondiff_operands=(0, 1, 2),
               doc="the cache with rows start..start+T-1 replaced (dynamic_update_slice)"))


# -- cached_attention --------------------------------------------------------------------
def _attn_infer(types, a):
    q, k, v, start = types
    _check_start(start, "cached_attention")
    if q.rank != 3 or k.rank != 3 or k.shape != v.shape or k.dtype != v.dtype:
        raise TraceError(f"cached_attention: expects q [T, H, D] and k, v [S, KV, D] of one "
                         f"type, got q {_fmt(q)}, k {_fmt(k)}, v {_fmt(v)}")
    if not (is_float(q.dtype) and is_float(k.dtype)):
        raise TraceError(f"cached_attention: q and the cache must be floats, got {q.dtype}, {k.dtype}")
    h, kv = q.shape[1], k.shape[1]
    if not (is_static(h) and is_static(kv) and h % kv == 0 and q.shape[2] == k.shape[2]):
        raise TraceError(f"cached_attention: q {_fmt(q)} and k {_fmt(k)}: the heads H must be a "
                         "static multiple of the kv heads KV, and the head dims D equal")
    check_window(a, "cached_attention")
    check_attr("cached_attention", types, a)
    return [q]


def check_window(a: dict, opname: str):
    """The `window` attribute: absent (None) or a positive int."""
    w = a.get("window")
    if w is not None and (isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 1):
        raise TraceError(f"{opname}: window must be a positive integer (the rows a query "
                         f"sees), got {w!r}")


def window_allowed(keys, query_positions, window):
    """[T, S] bool: key row s visible to the query at position p (s <= p, and with a
    window W, s > p - W)."""
    p = np.asarray(query_positions)[:, None]
    ok = np.asarray(keys)[None, :] <= p
    return ok if window is None else ok & (np.asarray(keys)[None, :] > p - int(window))



def _attn_ref(xs, a):
    q, k, v, start = xs
    t, h, d = q.shape
    s0, kvh = int(start), k.shape[1]
    n = s0 + t
    if s0 < 0 or n > k.shape[0]:
        raise TraceError(f"cached_attention: rows 0..{n - 1} are outside the cache of {k.shape[0]} rows")
    g = h // kvh
    kk = np.repeat(k[:n].astype(np.float64), g, axis=1)          # [n, H, D]
    vv = np.repeat(v[:n].astype(np.float64), g, axis=1)
    scores = np.einsum("thd,shd->hts", q.astype(np.float64), kk) * a["scale"]
    allowed = window_allowed(np.arange(n), s0 + np.arange(t), a.get("window"))   # [t, n]
    scores = np.where(allowed[None], scores, -np.inf)
    scores -= scores.max(-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(-1, keepdims=True)
    return [np.einsum("hts,shd->thd", p, vv).astype(q.dtype)]


def _amap(text):
    return ir.AffineMap.parse(text) if hasattr(ir.AffineMap, "parse") else \
        ir.Attribute.parse(f"affine_map<{text}>").value


def _empty(sizes, et=None):
    return tensor.EmptyOp(list(sizes), et or ir.F32Type.get()).result


def _filled(sizes, value):
    return linalg.fill(scalar_const(value, "f32"), outs=[_empty(sizes)])


def _generic(ins, maps, init, iters, body):
    """linalg.generic over `ins` into `init` with affine maps given as text ("(t, s) ->
    (t)") and `body(*scalars)` returning the yielded value."""
    out_t = ir.RankedTensorType(init.type)
    gop = linalg.GenericOp([out_t], list(ins), [init],
                           ir.ArrayAttr.get([ir.AffineMapAttr.get(_amap(m)) for m in maps]),
                           ir.ArrayAttr.get([ir.Attribute.parse(f"#linalg.iterator_type<{i}>")
                                             for i in iters]))
    types = [ir.RankedTensorType(x.type).element_type for x in ins] + [out_t.element_type]
    block = gop.regions[0].blocks.append(*types)
    with ir.InsertionPoint(block):
        linalg.YieldOp([body(*block.arguments)])
    return gop.result


def _softmax_parts(scores, tkgs):
    """(exp(scores - row max), the row sums) of masked scores [T, KV, G, S]: the row
    statistics laid out [T, KV, G], as the output rows that read them (see below)."""
    ident4, row = "(t, c, g, s) -> (t, c, g, s)", "(t, c, g, s) -> (t, c, g)"
    tkg = list(tkgs[:3])
    mx = _generic([scores], [ident4, row], _filled(tkg, float("-inf")), [PARALLEL] * 3 + [REDUCTION],
                  lambda x, acc: arith.MaximumFOp(acc, x).result)
    ex = _generic([scores, mx], [ident4, row, ident4], _empty(tkgs), [PARALLEL] * 4,
                  lambda x, m, _acc: math.ExpOp(arith.SubFOp(x, m).result).result)
    den = _generic([ex], [ident4, row], _filled(tkg, 0.0), [PARALLEL] * 3 + [REDUCTION],
                   lambda x, acc: arith.AddFOp(acc, x).result)
    return ex, den


def _normalized(acc, den, tkgd, tq, heads):
    """acc [T, KV, G, D] / den [T, KV, G], as the attention's output [T, H, D] f32."""
    ident = "(t, c, g, d) -> (t, c, g, d)"
    out = _generic([acc, den], [ident, "(t, c, g, d) -> (t, c, g)", ident], _empty(tkgd),
                   [PARALLEL] * 4, lambda x, s, _acc: arith.DivFOp(x, s).result)
    return tensor.CollapseShapeOp(ir.RankedTensorType.get([tq, heads, tkgd[3]], ir.F32Type.get()),
                                  out, [[0], [1, 2], [3]]).result


#: the most queries cached_attention computes with its decode form
DECODE_MAX_T = 4


def _attn_lower(ctx, op, xs):
    q, k, v, start = xs
    qt, kt = op.operands[0].type, op.operands[1].type
    heads, kvh, hd = int(qt.shape[1]), int(kt.shape[1]), int(qt.shape[2])
    group = heads // kvh
    f32 = ir.F32Type.get()
    kel = elem_type(kt.dtype)
    t = qt.shape[0] if is_static(qt.shape[0]) else value_dim(q, 0)
    tq = t if isinstance(t, int) else ir.ShapedType.get_dynamic_size()     # T in a type
    p = scalar_index(start)
    n = arith.AddIOp(p, index_const(t) if isinstance(t, int) else t).result
    # read only the rows 0..start+T-1 of the cache
    rows = ir.RankedTensorType.get([ir.ShapedType.get_dynamic_size(), kvh, hd], kel)
    kk = tensor.ExtractSliceOp(rows, k, *_slice_args([0, 0, 0], [n, kvh, hd])).result
    vv = tensor.ExtractSliceOp(rows, v, *_slice_args([0, 0, 0], [n, kvh, hd])).result

    def widen(x):
        return x if kel == f32 else arith.ExtFOp(f32, x).result

    def attend(decode: bool):
        """The attention, written for a few queries (`decode`) or for many. For a few,
        the dot products use math.fma, which IREE's data tiling does not take for a
        matmul: it would re-lay out every cache row read, on every call (measured: a
        decode step grew by ~6 us per cached position per layer, ~2 with fma). For many
        queries (prefill), the data-tiled matmuls are the faster form."""
        def madd(a, b, acc):
            if decode:
                return math.FmaOp(a, b, acc).result
            return arith.AddFOp(acc, arith.MulFOp(a, b).result).result

        scale = scalar_const(float(op.attrs["scale"]), "f32")
        # Heads as (kv head, group member): head h = kv * group + g reads kv head h //
        # group. Every map is a projection of the loop dims, no `floordiv`, which IREE
        # 3.13's CUDA tile-and-fuse crashes on (SIGSEGV in linalg::computeTileSizes).
        qel = ir.RankedTensorType(q.type).element_type
        qg = tensor.ExpandShapeOp(ir.RankedTensorType.get([tq, kvh, group, hd], qel), q,
                                  [[0], [1, 2], [3]], [] if isinstance(t, int) else [t],
                                  [tq, kvh, group, hd]).result
        # Every [T, KV, G] row statistic is laid out as the output rows [T, KV, G, D]
        # that read it: with the heads first (scores [h, t, s]) IREE 3.13's SPIR-V code
        # fused the softmax's sum into the division that reads it transposed, and
        # read other threads' sums (rows t % 4 < h of head h wrong on lavapipe).
        tkgs = [t, kvh, group, n]
        # scores[t, kv, g, s] = scale * sum_d q[t, kv, g, d] k[s, kv, d], masked to s <= start + t
        dot = _generic([qg, kk], ["(t, c, g, s, d) -> (t, c, g, d)", "(t, c, g, s, d) -> (s, c, d)",
                                 "(t, c, g, s, d) -> (t, c, g, s)"],
                      _filled(tkgs, 0.0), [PARALLEL] * 4 + [REDUCTION],
                      lambda x, y, acc: madd(x, widen(y), acc))
        neg_inf = scalar_const(float("-inf"), "f32")

        window = op.attrs.get("window")

        def mask(x, _acc):
            ti = linalg.IndexOp(0).result
            si = linalg.IndexOp(3).result
            pos = arith.AddIOp(p, ti).result
            ok = arith.CmpIOp(arith.CmpIPredicate.ule, si, pos).result
            if window is not None:      # s > pos - W, as s + W > pos (no negative index)
                near = arith.CmpIOp(arith.CmpIPredicate.ugt,
                                    arith.AddIOp(si, index_const(int(window))).result, pos).result
                ok = arith.AndIOp(ok, near).result
            return arith.SelectOp(ok, arith.MulFOp(x, scale).result, neg_inf).result
        ident4 = "(t, c, g, s) -> (t, c, g, s)"
        scores = _generic([dot], [ident4, ident4], _empty(tkgs), [PARALLEL] * 4, mask)
        ex, den = _softmax_parts(scores, tkgs)
        tkgd = [t, kvh, group, hd]
        # out[t, kv, g, d] = sum_s ex[t, kv, g, s] v[s, kv, d] / den[t, kv, g]
        acc = _generic([ex, vv], ["(t, c, g, d, s) -> (t, c, g, s)", "(t, c, g, d, s) -> (s, c, d)",
                                 "(t, c, g, d, s) -> (t, c, g, d)"],
                      _filled(tkgd, 0.0), [PARALLEL] * 4 + [REDUCTION],
                      lambda e, y, acc: madd(e, widen(y), acc))
        return _normalized(acc, den, tkgd, tq, heads)

    if isinstance(t, int):
        return [attend(decode=t <= DECODE_MAX_T)]
    few = arith.CmpIOp(arith.CmpIPredicate.ule, t, index_const(DECODE_MAX_T)).result
    branch = scf.IfOp(few, [ir.RankedTensorType.get([ir.ShapedType.get_dynamic_size(), heads, hd],
                                                    f32)], has_else=True)
    with ir.InsertionPoint(branch.then_block):
        scf.YieldOp([attend(decode=True)])
    with ir.InsertionPoint(branch.else_block):
        scf.YieldOp([attend(decode=False)])
    return [branch.results[0]]


register(OpDef("cached_attention", "cache", _attn_infer, _attn_ref, num_operands=4,
               attrs={"scale": REQUIRED, "window": None, "kernel": "generic"}, lower=_attn_lower,
               differentiable=False, nondiff_operands=(0, 1, 2, 3),
               doc="causal attention of q at positions start.. over cache rows 0..start+T-1 "
                   "(the `window` most recent of them, if given)"))


# -- rope ----------------------------------------------------------------------------------
ROPE_STYLES = ("neox", "interleaved")


def _rope_infer(types, a):
    x, cos, sin = types
    if a["style"] not in ROPE_STYLES:
        raise TraceError(f"rope: style must be one of {', '.join(ROPE_STYLES)}, got {a['style']!r}")
    if x.rank < 3 or not is_float(x.dtype) or not is_static(x.shape[-1]) or x.shape[-1] % 2 \
            or cos.shape != sin.shape or cos.dtype != x.dtype or sin.dtype != x.dtype \
            or cos.rank != 2 or not same_dim(cos.shape[0], x.shape[-3]) \
            or cos.shape[1] != x.shape[-1] // 2:
        raise TraceError(f"rope: expects x [..., T, H, D] with an even static D and cos, "
                         f"sin [T, D/2] of x's float type, got x {_fmt(x)}, cos {_fmt(cos)}, sin {_fmt(sin)}")
    check_attr("rope", types, a)
    return [x]


def _rope_ref(xs, a):
    x, c, s = xs
    d = x.shape[-1]
    c, s = c[:, None, :], s[:, None, :]              # [T, 1, D/2]: broadcast over heads and batch
    if a["style"] == "neox":
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return [np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return [np.stack([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).reshape(x.shape).astype(x.dtype)]


def _rope_decompose(b, operands, a):
    x, cos, sin = operands
    r, d = x.type.rank, x.type.shape[-1]
    c, s = b.expand_dims(cos, axis=1), b.expand_dims(sin, axis=1)            # [T, 1, D/2]
    if a["style"] == "neox":
        def half(i):
            return b.slice(x, starts=[0] * (r - 1) + [i * d // 2],
                           stops=[SLICE_END] * (r - 1) + [(i + 1) * d // 2], steps=[1] * r)
        axis = r - 1
    else:
        # the pairs (2i, 2i + 1) along a trailing axis of 2: [..., T, H, D/2, 2]
        pairs = b.reshape(x, shape=_shape_attr(x.type.shape[:-1]) + [d // 2, 2])

        def half(i):
            return b.slice(pairs, starts=[0] * r + [i], stops=[SLICE_END] * r + [i + 1],
                           steps=[1] * (r + 1))
        c, s = b.expand_dims(c, axis=3), b.expand_dims(s, axis=3)          # [T, 1, D/2, 1]
        axis = r
    x1, x2 = half(0), half(1)
    out = b.concatenate(b.sub(b.mul(x1, c), b.mul(x2, s)), b.add(b.mul(x2, c), b.mul(x1, s)),
                        axis=axis)
    return [out if axis == r - 1 else b.reshape(out, shape=_shape_attr(x.type.shape))]


def _rope_vjp(b, op, cts):
    """A rotation's transpose is the rotation by the opposite angle: rope(g, cos, -sin),
    one op where the decomposition's backward is eleven. cos and sin are position tables
    (constants); when they are computed values this declines (None) and autodiff goes
    through the decomposition, which gives them cotangents too."""
    x, cos, sin = op.operands
    if any(v.producer is None or v.producer.opname != "constant" for v in (cos, sin)):
        return None
    return [b.rope(cts[0], cos, b.neg(sin), **op.attrs), None, None]


def _shape_attr(shape) -> list:
    """A reshape's `shape` attribute for these dims: ints, and -1 for the first one that
    is not (the others must then be plain names)."""
    out = []
    for d in shape:
        if is_static(d):
            out.append(int(d))
        elif -1 not in out:
            out.append(-1)
        else:
            out.append(str(d))
    return out


def _rope_lower(ctx, op, xs):
    """The rotation as one elementwise linalg.generic over x viewed with its pairs on an
    axis of 2 ([..., 2, D/2] for "neox", [..., D/2, 2] for "interleaved"): element j of a
    pair reads both, computes the decomposition's x1 c - x2 s (j = 0) and x2 c + x1 s
    (j = 1) in the same order, and keeps its own. The decomposition's slices and
    concatenation would be copies (dispatches of their own) around it."""
    x_t = op.operands[0].type
    r, d = x_t.rank, x_t.shape[-1]
    neox = op.attrs["style"] == "neox"
    pairs = TensorType(x_t.shape[:-1] + ((2, d // 2) if neox else (d // 2, 2)), x_t.dtype)
    n = r + 1                                    # loops: x's leading dims, then the pair view
    j, i = (r - 1, r) if neox else (r, r - 1)    # the loop over a pair, and over D/2
    t = r - 3                                    # the sequence loop (cos, sin are [T, D/2])

    def x_at(k):
        exprs = list(range(r + 1))
        exprs[j] = ("c", k)
        return affine_map(n, exprs)

    table = affine_map(n, [t, i])

    def body(x1, x2, c, s, _out):
        first = arith.subf(arith.mulf(x1, c), arith.mulf(x2, s))
        second = arith.addf(arith.mulf(x2, c), arith.mulf(x1, s))
        is_first = arith.cmpi(arith.CmpIPredicate.eq, linalg.IndexOp(j).result, index_const(0))
        return arith.select(is_first, first, second)

    xp = reshape_value(ctx, xs[0], x_t, pairs)
    out = ctx.generic([xp, xp, xs[1], xs[2]], [x_at(0), x_at(1), table, table], pairs,
                      ir.AffineMap.get_identity(n), [PARALLEL] * n, body)
    return [reshape_value(ctx, out, pairs, x_t)]


register(OpDef("rope", "cache", _rope_infer, _rope_ref, num_operands=3,
               attrs={"style": "neox", "kernel": "generic"}, decompose=_rope_decompose,
               lower=_rope_lower, vjp=_rope_vjp,
               doc="rotary position embedding of x [..., T, H, D] by cos, sin [T, D/2]"))
