"""ternary: rewrite BitLinear-style matmuls into packed ternary kernels.

    matmul(x, ternarize(constant W), transpose_b=True)            (optionally x = act_quant(x'))
 -> reshape(ternary_matmul(reshape(x, [-1, K]), constant packed_i8), [..., N])

W [N, K] is ternarized (absmean, or the ternarize op's `scale` for a stored ternary
weight) and packed 2-bit planar at compile time, so no f32 copy
of the weights remains. `strategy` is "auto", a kernel of the strategy table
(`tercomp.codegen.ternary_strategies`), or "off" (the pass does nothing). `targets` are
the compile's target names: "auto" is settled here per target and per shape (a symbolic
batch gets a kernel that dispatches on the batch size at run time), so the module only
gets the kernels and flags it uses; an explicit strategy that does not compile for a
target is refused here, by name.
"""
from __future__ import annotations

import numpy as np

from ..ir import Graph
from ..codegen.ternary_strategies import check_strategy, choose_strategy
from ..ops import ternary_pack as tp
from .manager import register_pass
from .rewrite import dce, rewrite
from .simplify import const_value


def _dim(d):
    return int(d) if isinstance(d, (int, np.integer)) else str(d)


def _pattern(strategy, targets):
    def pat(b, op, xs):
        if not op.attrs.get("transpose_b"):
            return None
        x, wv = xs
        tern = wv.producer
        if tern is None or tern.opname != "ternarize":
            return None
        w = const_value(tern.operands[0])
        if w is None or w.ndim != 2 or w.dtype != np.float32 or x.dtype != "f32" or x.type.rank < 2:
            return None
        aq = False
        if x.producer is not None and x.producer.opname == "act_quant":
            x, aq = x.producer.operands[0], True
        n, k = w.shape
        if x.type.shape[-1] != k:
            return None
        # a stored ternary weight (nn.BitLinear.from_ternary) carries its own scale: absmean
        # of scale * T would give scale * density, and T must come back exactly
        fixed = tern.attrs.get("scale")
        t, scale = tp.absmean_ternarize(w) if fixed is None else tp.ternarize_with_scale(w, fixed)
        packed = b.constant(tp.pack_ternary(t).view(np.int8), name="packed")
        lead = list(x.type.shape[:-1])
        x2 = x if x.type.rank == 2 else b.reshape(x, shape=[-1, k])
        m = x2.type.shape[0]
        # "auto" is settled here, per shape, so the module only gets the flags it uses
        chosen = choose_strategy(m if isinstance(m, int) else None, int(k), int(n), targets) \
            if strategy == "auto" else strategy
        y = b.ternary_matmul(x2, packed, k=int(k), n=int(n), scale=float(scale),
                             strategy=chosen, act_quant=aq, name=op.results[0].name)
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
        return b.ternary_matmul(x, p, **{**op.attrs, "strategy": chosen},
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
