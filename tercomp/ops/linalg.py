"""matmul: NumPy matmul of rank >= 2 operands with broadcast batch dims, optionally with
the rhs given transposed (`transpose_b`: b is [..., N, K], as nn.Linear stores weights).

widening_matmul(x, w[, scale]): y[M, N] = x[M, K] @ f32(w)[N, K]^T (* scale[N]) for f32 x
and weights stored narrower (f16, int8 with a per-row f32 scale): the weights are widened
inside the kernel, so they stay narrow in memory. `kernel` "avx2" takes the hand-written
GEMV of kernels/dense/widening_avx2.py (f16, or int8 with a scale; K a multiple of 16; compile_lm
picks it for an AVX2 host), "generic" one linalg contraction. Inference only (a language
model's output layer).

Matmul is bilinear: its VJP is an lhs rule and an rhs rule, each a matmul of the
cotangent with the other operand, then summed over the batch dims that were broadcast.
"""
from __future__ import annotations

import numpy as np
from iree.compiler import ir
from iree.compiler.dialects import arith, linalg, math

from ..kernels.table import check_attr
from ..codegen.builders import PARALLEL, REDUCTION, affine_map
from ..errors import TraceError
from ..ir import TensorType, is_static
from ..ir.types import is_float
from .elementwise import broadcast_shapes
from .registry import OpDef, register
from .shape import unbroadcast
from .shape_util import fmt_shape, same_dim


def _matmul_dims(a: TensorType, b: TensorType, transpose_b: bool):
    """(batch shape, M, K, N) of a matmul, or a TraceError naming both shapes."""
    shown = f"{fmt_shape(a.shape)} and {fmt_shape(b.shape)}" + (" (transpose_b)" if transpose_b else "")
    if a.rank < 2 or b.rank < 2:
        raise TraceError(f"matmul: operands {shown} must both have rank >= 2",
                         hint="tern.matmul takes matrices; the tracer turns a 1-D operand into a "
                              "matrix with expand_dims and removes that dim after with squeeze")
    if a.dtype != b.dtype:
        raise TraceError(f"matmul: operands {shown} have different dtypes {a.dtype} and {b.dtype}",
                         hint="cast one operand with x.astype(dtype)")
    m, k = a.shape[-2:]
    n, kb = (b.shape[-2], b.shape[-1]) if transpose_b else (b.shape[-1], b.shape[-2])
    if not same_dim(k, kb):
        raise TraceError(f"matmul: contraction dims differ for {shown}: {k} vs {kb}",
                         hint="the last dim of a must equal the " +
                              ("last" if transpose_b else "second-to-last") + " dim of b")
    try:
        batch = broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except TraceError:
        raise TraceError(f"matmul: batch dims of {shown} cannot be broadcast together",
                         hint="the leading dims must be equal or 1") from None
    return batch, m, k, n


def _matmul_infer(types, attrs):
    a, b = types
    batch, m, _, n = _matmul_dims(a, b, attrs["transpose_b"])
    check_attr("matmul", types, attrs)
    return [TensorType(tuple(batch) + (m, n), a.dtype)]


def _matmul_ref(xs, attrs):
    a, b = xs
    if attrs["transpose_b"]:
        b = np.swapaxes(b, -1, -2)
    return [np.matmul(a, b).astype(a.dtype)]


def _matmul_lower(ctx, op, xs):
    a_t, b_t = (v.type for v in op.operands)
    out = op.results[0].type
    init = ctx.fill(out, 0)
    tb = op.attrs["transpose_b"]
    if a_t.rank == b_t.rank == 2 and not tb:
        return [linalg.matmul(xs[0], xs[1], outs=[init])]
    # A generic contraction over (batch..., m, n, k); a batch dim of size 1 that is
    # broadcast reads index 0 (the same rule as NumPy broadcasting).
    nb = out.rank - 2
    m, n, k = nb, nb + 1, nb + 2

    def batch_exprs(t):
        lead = t.rank - 2
        return [("c", 0) if (d == 1 and out.shape[nb - lead + i] != 1) else nb - lead + i
                for i, d in enumerate(t.shape[:-2])]

    a_map = affine_map(nb + 3, batch_exprs(a_t) + [m, k])
    b_map = affine_map(nb + 3, batch_exprs(b_t) + ([n, k] if tb else [k, n]))
    o_map = affine_map(nb + 3, list(range(nb)) + [m, n])
    fl = is_float(out.dtype)

    def body(x, y, acc):
        prod = (arith.MulFOp if fl else arith.MulIOp)(x, y).result
        return (arith.AddFOp if fl else arith.AddIOp)(acc, prod).result

    return [ctx.generic(xs, [a_map, b_map], out, o_map, [PARALLEL] * (nb + 2) + [REDUCTION],
                        body, init=init)]


def _swap_last(b, v):
    perm = list(range(v.type.rank))
    perm[-2], perm[-1] = perm[-1], perm[-2]
    return b.transpose(v, perm=perm)


def matmul_lhs_rule(b, g, rhs, transpose_b: bool):
    """Cotangent of a in a @ rhs (before unbroadcasting): g @ rhs^T."""
    return b.matmul(g, rhs, transpose_b=not transpose_b)


def matmul_rhs_rule(b, g, lhs, transpose_b: bool):
    """Cotangent of rhs in lhs @ rhs (before unbroadcasting): lhs^T @ g, or g^T @ lhs
    when rhs is stored transposed."""
    if transpose_b:
        return b.matmul(_swap_last(b, g), lhs)
    return b.matmul(_swap_last(b, lhs), g)


def _matmul_vjp(b, op, cts):
    lhs, rhs = op.operands
    g, tb = cts[0], op.attrs["transpose_b"]
    return [_lhs_cotangent(b, g, lhs, rhs, tb), _rhs_cotangent(b, g, lhs, rhs, tb)]


#: A matrix lhs shared by a batch of rhs (W @ x[B, K, N]: BitConv's W @ rows^T, N the
#: output positions of one image) takes its cotangent as one 2-D matmul over all B * N
#: columns where each batch contracts fewer than this many; as a batched matmul summed
#: over B (IREE keeps the sum apart: reduce.py) from this many on. Measured on the
#: 2-core Xeon VM (bench/RESULTS.md, 64..512 x 576..4608 weights over 32 images):
#: batched 0.25x the flattened time at N = 1024 and 256, 0.75x at 64, 3-4x at 16.
BATCHED_LHS_MIN_N = 64


def _lhs_cotangent(b, g, lhs, rhs, tb: bool):
    """The cotangent of lhs: g @ rhs^T, summed over the batch dims lhs was broadcast on.
    A matrix lhs shared by a rank-3 rhs with a small N per batch (see BATCHED_LHS_MIN_N)
    takes one matmul of g's columns of every batch (g [B, M, N] -> [M, B * N], a
    transpose) against rhs's rows."""
    n = g.type.shape[-1]
    if lhs.type.rank == 2 and rhs.type.rank == 3 and g.type.rank == 3 and g.type.is_static \
            and rhs.type.is_static and int(n) < BATCHED_LHS_MIN_N:
        m = int(g.type.shape[-2])
        g_cols = b.reshape(b.transpose(g, perm=[1, 0, 2]), shape=[m, -1])           # [M, B * N]
        if tb:                                                      # rhs [B, N, K]
            return b.matmul(g_cols, b.reshape(rhs, shape=[-1, int(rhs.type.shape[-1])]))
        # rhs [B, K, N]: (g_cols @ rhs_cols^T) with rhs_cols [K, B * N], as a matmul_sum of
        # one (the kernel table's f32 kernel reads rhs_cols as it is; a matmul's
        # transposed operand it does not take)
        rhs_cols = b.reshape(b.transpose(rhs, perm=[1, 0, 2]), shape=[int(rhs.type.shape[-2]), -1])
        return b.matmul_sum(b.expand_dims(g_cols, axis=0), b.expand_dims(rhs_cols, axis=0))
    if lhs.type.rank == 2 and rhs.type.rank == 3 and g.type.rank == 3 and g.type.is_static \
            and rhs.type.is_static and not tb:
        # one op for the batched g @ rhs^T and its sum over B: the kernel table has a
        # kernel that sums inside it (kernels/dense/gemm_avx512.py)
        return b.matmul_sum(g, rhs)
    return unbroadcast(b, matmul_lhs_rule(b, g, rhs, tb), lhs.type)


def _rhs_cotangent(b, g, lhs, rhs, tb: bool):
    """The cotangent of rhs. A matrix rhs shared by every batch of lhs (x [B, T, K] @ W,
    a layer's weight) takes one matmul over all B * T rows of g and lhs, instead of a
    batched matmul whose [B, N, K] result is then summed over B: half the ops, and no
    B-times larger intermediate."""
    k, n = lhs.type.shape[-1], g.type.shape[-1]
    if rhs.type.rank == 2 and lhs.type.rank > 2 and is_static(k) and is_static(n):
        g_rows, lhs_rows = b.reshape(g, shape=[-1, int(n)]), b.reshape(lhs, shape=[-1, int(k)])
        return matmul_rhs_rule(b, g_rows, lhs_rows, tb)
    return unbroadcast(b, matmul_rhs_rule(b, g, lhs, tb), rhs.type)


register(OpDef("matmul", "linalg", _matmul_infer, _matmul_ref, num_operands=2,
               attrs={"transpose_b": False, "kernel": "generic"}, lower=_matmul_lower,
               vjp=_matmul_vjp,
               doc="a @ b (or a @ b^T with transpose_b) for rank >= 2, batch dims broadcast"))


def _matmul_sum_infer(types, attrs):
    a, x = types
    if a.rank != 3 or x.rank != 3 or a.dtype != x.dtype or not same_dim(a.shape[0], x.shape[0]) \
            or not same_dim(a.shape[2], x.shape[2]):
        raise TraceError(f"matmul_sum expects a [B, M, N] and x [B, K, N] of one dtype, got "
                         f"{a.mlir()} and {x.mlir()}")
    check_attr("matmul_sum", types, attrs)
    return [TensorType((a.shape[1], x.shape[1]), a.dtype)]


def _matmul_sum_ref(xs, attrs):
    a, x = xs
    return [np.einsum("bmn,bkn->mk", a, x).astype(a.dtype)]


def _matmul_sum_decompose(b, operands, attrs):
    """The batched matmul, then the sum over B (what the lhs cotangent of a shared
    matrix was before this op: unbroadcast of g @ rhs^T)."""
    a, x = operands
    if a.type.shape[0] == 1:            # a batch of one: the product itself
        return b.squeeze(b.matmul(a, x, transpose_b=True), axes=[0])
    return b.sum(b.matmul(a, x, transpose_b=True), axes=[0])


register(OpDef("matmul_sum", "linalg", _matmul_sum_infer, _matmul_sum_ref, num_operands=2,
               attrs={"kernel": "generic"}, decompose=_matmul_sum_decompose,
               doc="sum over b of a[b] @ x[b]^T: a [B, M, N], x [B, K, N] -> [M, K] (the "
                   "cotangent of a matrix shared by a batch of matmuls, a convolution's weight)"))


WIDENING_DTYPES = ("f32", "f16", "i8")


def _wm_infer(types, attrs):
    if len(types) not in (2, 3):
        raise TraceError(f"widening_matmul takes x, w and an optional scale, got {len(types)} operands")
    x, w = types[:2]
    if x.rank != 2 or x.dtype != "f32" or w.rank != 2 or w.dtype not in WIDENING_DTYPES \
            or not same_dim(x.shape[1], w.shape[1]):
        raise TraceError(f"widening_matmul expects x [M, K] f32 and weights [N, K] f32, f16 "
                         f"or i8, got {x.mlir()} and {w.mlir()}")
    if len(types) == 3 and (types[2].rank != 1 or types[2].dtype != "f32"
                            or not same_dim(types[2].shape[0], w.shape[0])):
        raise TraceError(f"widening_matmul: the scale must be [N] f32 for weights {w.mlir()}, "
                         f"got {types[2].mlir()}")
    check_attr("widening_matmul", types, attrs)
    return [TensorType((x.shape[0], w.shape[0]), "f32")]


def _wm_ref(xs, attrs):
    x, w = xs[:2]
    y = x @ np.asarray(w, np.float32).T
    return [(y * xs[2] if len(xs) == 3 else y).astype(np.float32)]


def _wm_lower(ctx, op, xs):
    x_t, w_t = (v.type for v in op.operands[:2])
    n, k = w_t.shape
    scaled = len(xs) == 3
    f32 = ir.F32Type.get()

    def widen(v):
        if isinstance(v.type, ir.IntegerType):
            return arith.sitofp(f32, v)
        return v if v.type == f32 else arith.extf(f32, v)

    out = op.results[0].type
    # an fma body: IREE's data tiling (on for modules with blocked ternary kernels) skips
    # it, instead of re-laying out the weights on every call
    y = ctx.generic(xs[:2], [affine_map(3, [0, 2]), affine_map(3, [1, 2])], out,
                    affine_map(3, [0, 1]), [PARALLEL, PARALLEL, REDUCTION],
                    lambda a, b, acc: math.fma(a, widen(b), acc), init=ctx.fill(out, 0.0))
    if not scaled:
        return [y]
    return [ctx.generic([y, xs[2]], [affine_map(2, [0, 1]), affine_map(2, [1])], out,
                        affine_map(2, [0, 1]), [PARALLEL, PARALLEL],
                        lambda a, s, _acc: arith.mulf(a, s))]


register(OpDef("widening_matmul", "linalg", _wm_infer, _wm_ref, num_operands=None,
               attrs={"kernel": "generic"}, lower=_wm_lower, vjp=None, differentiable=False,
               nondiff_operands=(0, 1, 2),
               doc="x @ f32(w)^T (* scale) for f32 x [M, K] and narrow weights w [N, K] (f16, i8)"))
