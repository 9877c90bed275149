"""KV-cache ops over SLOTS: the cache of a batched generator (tc.compile_lm with
max_batch > 1) holds one sequence per slot, and one call mixes tokens of several
sequences, each at its own position (decode steps of running streams, a chunk of a new
prompt; the "ragged batch" of vLLM's attention backends).

- `kv_scatter(cache [N, S, KV, D], rows [T, KV, D], slots [T], positions [T]) {kernel}`:
  the cache with row t written at (slots[t], positions[t]), updated in place in a global.
  The pairs must be distinct. `kernel` "generic" is IREE's `iree_linalg_ext.scatter`
  (0.03 ms for a row of a 64 MiB cache; it copies element by element); "cpu" (the kernel
  table's row, where it fits) is kernels/rows/rows_cpu.py's kv_write, one workgroup a
  row of 64-byte vector copies in a dispatch tied to the cache.
- `slot_attention(q [T, H, D], k [N, S, KV, D], v, slots [T], positions [T]) {scale,
  window, kernel}`: causal softmax attention of query t over the rows 0..positions[t] of
  its slot slots[t] (which this call's kv_scatter has written up to positions[t]); with
  `window` W only the W most recent of them (a sliding-window layer).
  Grouped-query as cached_attention (ops/kv_cache_ops.py). `kernel` "cpu" (the kernel
  table's row, where it fits as cached_attention's) is the hand-written dispatch of
  kernels/attention/attention_cpu.py (rows past a query's position are never read);
  "generic", the lowering here, is linalg over all S rows, masked (for the GPU targets).

slots and positions are i32 [T]; out-of-range values are undefined in the compiled code
(the NumPy references raise): the generator checks them on the host.
"""
from __future__ import annotations

import numpy as np

from iree.compiler import ir
from iree.compiler.dialects import arith, linalg, math, tensor

from ..kernels.table import check_attr
from ..codegen.builders import PARALLEL, REDUCTION, elem_type, index_const, scalar_const, value_dim
from ..errors import TraceError
from ..ir import TensorType, is_static
from ..ir.types import is_float
from .kv_cache_ops import (_empty, _filled, _fmt, _generic, _normalized, _softmax_parts,
                           check_window)
from .registry import OpDef, REQUIRED, register
from .shape_util import same_dim


def _check_index(types, opname: str, t):
    for what, x in zip(("slots", "positions"), types):
        if x.rank != 1 or x.dtype != "i32" or not same_dim(x.shape[0], t):
            raise TraceError(f"{opname}: {what} must be i32 [T] with T = {t}, got {_fmt(x)}")


def _check_cache(cache: TensorType, opname: str):
    if cache.rank != 4 or not all(is_static(d) for d in cache.shape):
        raise TraceError(f"{opname}: the cache must be a static [N, S, KV, D], got {_fmt(cache)}")


def _check_rows(cache, slots, positions, opname: str):
    n, s = cache.shape[0], cache.shape[1]
    bad = (slots < 0) | (slots >= n) | (positions < 0) | (positions >= s)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise TraceError(f"{opname}: row {i} is at slot {slots[i]}, position {positions[i]}: "
                         f"outside the cache of {n} slots x {s} rows")


# -- kv_scatter ---------------------------------------------------------------------------
def _scatter_infer(types, a):
    cache, rows, slots, positions = types
    _check_cache(cache, "kv_scatter")
    if rows.rank != 3 or rows.dtype != cache.dtype or tuple(rows.shape[1:]) != tuple(cache.shape[2:]):
        raise TraceError(f"kv_scatter: rows {_fmt(rows)} do not fit the cache {_fmt(cache)}",
                         hint="rows are [T, KV, D] of the cache's dtype")
    _check_index([slots, positions], "kv_scatter", rows.shape[0])
    check_attr("kv_scatter", types, a)
    return [cache]


def _scatter_ref(xs, a):
    cache, rows, slots, positions = xs
    _check_rows(cache, slots, positions, "kv_scatter")
    if len(set(zip(slots.tolist(), positions.tolist()))) != len(slots):
        raise TraceError("kv_scatter: two rows are written at the same (slot, position)")
    out = cache.copy()
    out[slots, positions] = rows
    return [out]


def _scatter_lower(ctx, op, xs):
    cache, rows, slots, positions = xs
    i32 = ir.IntegerType.get_signless(32)
    t = value_dim(rows, 0)
    tq = op.operands[1].type.shape[0]
    # indices [T, 2] = (slot, position) of each row
    pair = _generic([slots, positions], ["(t, j) -> (t)", "(t, j) -> (t)", "(t, j) -> (t, j)"],
                    tensor.EmptyOp([int(tq) if is_static(tq) else t, 2], i32).result,
                    [PARALLEL, PARALLEL],
                    lambda s, p, _o: arith.SelectOp(
                        arith.CmpIOp(arith.CmpIPredicate.eq, linalg.IndexOp(1).result,
                                     index_const(0)).result, s, p).result)
    scatter = ir.Operation.create(
        "iree_linalg_ext.scatter", results=[cache.type], operands=[rows, pair, cache],
        attributes={"dimension_map": ir.DenseI64ArrayAttr.get([0, 1]),
                    "unique_indices": ir.BoolAttr.get(True)}, regions=1)
    et = ir.RankedTensorType(cache.type).element_type
    block = scatter.regions[0].blocks.append(et, et)
    with ir.InsertionPoint(block):
        ir.Operation.create("iree_linalg_ext.yield", operands=[block.arguments[0]])
    return [scatter.result]


register(OpDef("kv_scatter", "cache", _scatter_infer, _scatter_ref, num_operands=4,
               attrs={"kernel": "generic"}, lower=_scatter_lower, differentiable=False,
               nondiff_operands=(0, 1, 2, 3),
               doc="the cache [N, S, ...] with row t written at (slots[t], positions[t])"))


# -- slot_attention -----------------------------------------------------------------------
def _attn_infer(types, a):
    q, k, v, slots, positions = types
    _check_cache(k, "slot_attention")
    if q.rank != 3 or k.shape != v.shape or k.dtype != v.dtype or not is_float(q.dtype) \
            or not is_float(k.dtype):
        raise TraceError(f"slot_attention: expects q [T, H, D] and k, v [N, S, KV, D] floats of "
                         f"one type, got q {_fmt(q)}, k {_fmt(k)}, v {_fmt(v)}")
    h, kv = q.shape[1], k.shape[2]
    if not (is_static(h) and h % kv == 0 and q.shape[2] == k.shape[3]):
        raise TraceError(f"slot_attention: q {_fmt(q)} and k {_fmt(k)}: the heads H must be a "
                         "static multiple of the kv heads KV, and the head dims D equal")
    _check_index([slots, positions], "slot_attention", q.shape[0])
    check_window(a, "slot_attention")
    check_attr("slot_attention", types, a)
    return [q]


def _attn_ref(xs, a):
    q, k, v, slots, positions = xs
    _check_rows(k, slots, positions, "slot_attention")
    g = q.shape[1] // k.shape[2]
    win = a.get("window")
    out = np.empty(q.shape, q.dtype)
    for t, (b, p) in enumerate(zip(slots.tolist(), positions.tolist())):
        lo = 0 if win is None else max(0, p + 1 - int(win))
        kk = np.repeat(k[b, lo:p + 1].astype(np.float64), g, axis=1)      # [rows, H, D]
        vv = np.repeat(v[b, lo:p + 1].astype(np.float64), g, axis=1)
        s = np.einsum("hd,shd->hs", q[t].astype(np.float64), kk) * a["scale"]
        w = np.exp(s - s.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        out[t] = np.einsum("hs,shd->hd", w, vv)
    return [out]


def _attn_lower(ctx, op, xs):
    q, k, v, slots, positions = xs
    qt, kt = op.operands[0].type, op.operands[1].type
    t = value_dim(q, 0)
    return [_generic_attention(q, k, v, slots, positions, t, qt, kt, float(op.attrs["scale"]),
                               op.attrs.get("window"))]


def _generic_attention(q, k, v, slots, positions, t, qt, kt, scale, window=None):
    """linalg: every query over all S rows of its slot (gathered with tensor.extract in
    the loop bodies), rows past its position masked; the heads as (kv head, group
    member), row statistics laid out [T, KV, G] (see ops/kv_cache_ops.py for why)."""
    heads, kvh, hd, s_len = int(qt.shape[1]), int(kt.shape[2]), int(qt.shape[2]), int(kt.shape[1])
    group = heads // kvh
    f32, idx = ir.F32Type.get(), ir.IndexType.get()
    kel = elem_type(kt.dtype)
    dyn = ir.ShapedType.get_dynamic_size()
    tq = int(qt.shape[0]) if is_static(qt.shape[0]) else dyn
    tv = int(qt.shape[0]) if is_static(qt.shape[0]) else t
    qel = ir.RankedTensorType(q.type).element_type
    qg = tensor.ExpandShapeOp(ir.RankedTensorType.get([tq, kvh, group, hd], qel), q,
                              [[0], [1, 2], [3]], [] if tq != dyn else [t],
                              [tq, kvh, group, hd]).result

    def widen(x):
        return x if kel == f32 else arith.ExtFOp(f32, x).result

    def read(cache, slot, s_dim, d_dim):
        b = arith.IndexCastOp(idx, slot).result
        c = linalg.IndexOp(1).result
        return widen(tensor.ExtractOp(cache, [b, linalg.IndexOp(s_dim).result, c,
                                              linalg.IndexOp(d_dim).result]).result)

    tkgs, tkgd = [tv, kvh, group, s_len], [tv, kvh, group, hd]
    dot = _generic([qg, slots], ["(t, c, g, s, d) -> (t, c, g, d)", "(t, c, g, s, d) -> (t)",
                                 "(t, c, g, s, d) -> (t, c, g, s)"],
                   _filled(tkgs, 0.0), [PARALLEL] * 4 + [REDUCTION],
                   lambda x, b, acc: math.FmaOp(x, read(k, b, 3, 4), acc).result)
    scale_v, neg_inf = scalar_const(scale, "f32"), scalar_const(float("-inf"), "f32")
    i32 = ir.IntegerType.get_signless(32)

    def mask(x, p, _acc):
        si = arith.IndexCastOp(i32, linalg.IndexOp(3).result).result
        ok = arith.CmpIOp(arith.CmpIPredicate.sle, si, p).result
        if window is not None:      # s > p - W, as s + W > p
            w = arith.ConstantOp(i32, int(window)).result
            near = arith.CmpIOp(arith.CmpIPredicate.sgt, arith.AddIOp(si, w).result, p).result
            ok = arith.AndIOp(ok, near).result
        return arith.SelectOp(ok, arith.MulFOp(x, scale_v).result, neg_inf).result
    ident4 = "(t, c, g, s) -> (t, c, g, s)"
    scores = _generic([dot, positions], [ident4, "(t, c, g, s) -> (t)", ident4], _empty(tkgs),
                      [PARALLEL] * 4, mask)
    ex, den = _softmax_parts(scores, tkgs)
    acc = _generic([ex, slots], ["(t, c, g, d, s) -> (t, c, g, s)", "(t, c, g, d, s) -> (t)",
                                 "(t, c, g, d, s) -> (t, c, g, d)"],
                   _filled(tkgd, 0.0), [PARALLEL] * 4 + [REDUCTION],
                   lambda e, b, acc: math.FmaOp(e, read(v, b, 4, 3), acc).result)
    return _normalized(acc, den, tkgd, tq, heads)


register(OpDef("slot_attention", "cache", _attn_infer, _attn_ref, num_operands=5,
               attrs={"scale": REQUIRED, "window": None, "kernel": "generic"}, lower=_attn_lower,
               differentiable=False, nondiff_operands=(0, 1, 2, 3, 4),
               doc="causal attention of query t over rows 0..positions[t] of cache slot slots[t] "
                   "(the `window` most recent of them, if given)"))
