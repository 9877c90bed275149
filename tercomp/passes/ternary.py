"""ternary: rewrite BitLinear-style matmuls into packed ternary kernels.

    matmul(x, ternarize(constant W), transpose_b=True)            (optionally x = act_quant(x'))
    matmul(x, ternary_weight(constant packed), transpose_b=True)
 -> reshape(ternary_matmul(reshape(x, [-1, K]), constant packed_i8), [..., N])

W [N, K] is ternarized (absmean, or the ternarize op's `scale`) and packed 2-bit planar
at compile time, so no f32 copy of the weights remains; a stored ternary weight
(`nn.BitLinear.from_ternary`, `ternary_weight`) is already packed and is used as it is. `strategy` is "auto", a kernel of the strategy table
(`tercomp.codegen.ternary_strategies`), or "off" (the pass does nothing). `targets` are
the compile's target names: "auto" is settled here per target and per shape (a symbolic
batch gets a kernel that dispatches on the batch size at run time), so the module only
gets the kernels and flags it uses; an explicit strategy that does not compile for a
target is refused here, by name.
"""
from __future__ import annotations

import numpy as np

from ..ir import Graph
from ..codegen.ternary_strategies import check_strategy, choose_strategy, weight_codes
from .. import ternary_pack as tp
from ..ops.shape_util import same_dim
from .manager import register_pass
from .rewrite import dce, rewrite
from .simplify import const_value


def _dim(d):
    return int(d) if isinstance(d, (int, np.integer)) else str(d)


def _packed_weight(b, w):
    """(packed i8 value, N, K, scale) of a matmul's ternary rhs, or None: a stored weight
    (`ternary_weight` of packed constant bytes, used as they are), or `ternarize` of an f32
    constant, ternarized and packed here (absmean, or the op's fixed `scale`)."""
    if w is None:
        return None
    if w.opname == "ternary_weight" and const_value(w.operands[0]) is not None:
        n, k = w.results[0].type.shape
        return w.operands[0], n, k, float(w.attrs["scale"])
    if w.opname != "ternarize":
        return None
    c = const_value(w.operands[0])
    if c is None or c.ndim != 2 or c.dtype != np.float32:
        return None
    fixed = w.attrs.get("scale")
    t, scale = tp.absmean_ternarize(c) if fixed is None else tp.ternarize_with_scale(c, fixed)
    n, k = c.shape
    return b.constant(tp.pack_ternary(t).view(np.int8), name="packed"), n, k, float(scale)


def _coded(b, packed, strategy, k, n):
    """(packed, attrs): a constant weight re-coded to the 2-bit format that `strategy`
    reads fastest (`weight_codes`), with the `codes` attribute that says so; any other
    weight as it is (every kernel reads the signed codes)."""
    codes = weight_codes(strategy, k, n)
    value = const_value(packed)
    if codes == "signed" or value is None:
        return packed, {}
    recoded = tp.to_offset_codes(value.view(np.uint8)).view(np.int8)
    return b.constant(recoded, name=packed.name), {"codes": codes}


def _pattern(strategy, targets):
    def pat(b, op, xs):
        if not op.attrs.get("transpose_b"):
            return None
        x, wv = xs
        if x.dtype != "f32" or x.type.rank < 2 or wv.type.rank != 2 or \
                not same_dim(x.type.shape[-1], wv.type.shape[1]):
            return None
        found = _packed_weight(b, wv.producer)
        if found is None:
            return None
        packed, n, k, scale = found
        aq = False
        if x.producer is not None and x.producer.opname == "act_quant":
            x, aq = x.producer.operands[0], True
        lead = list(x.type.shape[:-1])
        x2 = x if x.type.rank == 2 else b.reshape(x, shape=[-1, k])
        m = x2.type.shape[0]
        # "auto" is settled here, per shape, so the module only gets the flags it uses
        chosen = choose_strategy(m if isinstance(m, int) else None, int(k), int(n), targets) \
            if strategy == "auto" else strategy
        if aq:
            packed, coded = _coded(b, packed, chosen, int(k), int(n))
        else:
            coded = {}
        y = b.ternary_matmul(x2, packed, k=int(k), n=int(n), scale=float(scale),
                             strategy=chosen, act_quant=aq, name=op.results[0].name, **coded)
        if x.type.rank != 2:
            y = b.reshape(y, shape=[_dim(d) for d in lead] + [int(n)])
        return y
    return pat


def _settle_auto(strategy, targets):
    """A ternary_matmul already in the IR (parsed, or built by a model) with strategy
    "auto" gets the kernel for `targets` too; an explicit strategy argument wins."""
    def pat(b, op, xs):
        if op.attrs.get("strategy") != "auto":
            return None
        x, p = xs
        m = x.type.shape[0]
        k, n = int(op.attrs["k"]), int(op.attrs["n"])
        chosen = choose_strategy(m if isinstance(m, int) else None, k, n, targets) \
            if strategy == "auto" else strategy
        coded = {}
        if op.attrs["act_quant"] and op.attrs.get("codes", "signed") == "signed":
            p, coded = _coded(b, p, chosen, k, n)
        return b.ternary_matmul(x, p, **{**op.attrs, "strategy": chosen, **coded},
                                name=op.results[0].name)
    return pat


@register_pass("ternary")
def ternary(graph: Graph, strategy: str = "auto", targets=("llvm-cpu",)) -> Graph:
    """Rewrite matmul(x, ternarize(const W), transpose_b=True) into tern.ternary_matmul
    with the kernel `strategy` (settled per shape for `targets` when "auto")."""
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    if check_strategy(strategy, targets) == "off":
        return graph
    return dce(rewrite(graph, {"matmul": [_pattern(strategy, targets)],
                               "ternary_matmul": [_settle_auto(strategy, targets)]}))
