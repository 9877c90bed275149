"""The output-layer kernel of a language model on an AVX2 host: y[M, N] = x[M, K] @ W^T
with W [N, K] stored in f16 and widened in registers (`vcvtph2ps`), so a decode step
reads 2 bytes per weight; or stored in int8 with a per-row f32 scale (y[m, r] = scale[r]
* sum_k x[m, k] f32(W[r, k]), widened by `vpmovsxbd` + `vcvtdq2ps`): 1 byte per weight. A hand-written dispatch like `kernels.ternary.avx2` (same reasons:
IREE's data tiling re-lays out a widening matmul's weights on every call, 146 ms a
token at the 700M shape, and without data tiling its generic GEMV ran at ~5 GB/s):

    for 4 rows at a time, one from each quarter of the workgroup's rows (then the
    remaining rows one by one):
        for each row m of x:
            acc_r += f32(W[r, k:k+16]) * x[m, k:k+16]      16 lanes, 2 FMA chains a row
            (each row's bytes prefetched two rows of its quarter ahead)
        y[m, r] = sum(acc_r)        a shuffle tree (fastmath<reassoc>)

The rows are split into about 32 workgroups. M may be anything (a prefill that wants
every position's logits re-reads each row group from L1 per row of x).

From M = 4 on, the cost is the arithmetic, not the table's reads (at M = 8 ~4x M = 1's
CPU time on the 2-core Xeon VM). The sums in lane order took 16 dependent `vaddss` an
output (~15% of the instructions at M = 8); the tree takes 4 adds,
10-15% less CPU time at M = 8 and 128, M = 1 alike. Blocks of 8 rows of x (2 weight
rows x 8, 16 accumulators, no spill) widen each weight vector once at M = 8 but measured
no faster there and 5-15% slower at M = 128, likely because 8 rows of x (48 KiB at
K = 1536) fill the 48 KiB L1 where 4 leave room for the weights (bench/RESULTS.md,
`bench/output_layer.py`).
"""
from __future__ import annotations

from iree.compiler import ir

from ...codegen.executables import dispatch, ensure_executable, split_rows
from ..host import host_cpu_features
from ..template import render

ROWS = 4
LANES = 16
PREFETCH_ROWS = 8
#: The 4 rows of a step come from 4 streams, a quarter of the workgroup's rows each,
#: prefetched into L1 this many rows ahead: far-apart streams keep more DRAM reads in
#: flight than adjacent rows (see `kernels.ternary.avx2.STREAM_AHEAD`).
STREAM_AHEAD = 2
WORKGROUPS = 32


def m_block() -> int:
    """Rows of x that share each widened weight vector (a batched decode's rows): ROWS x
    m_block accumulators of LANES floats stay in registers, 16 zmm of AVX-512's 32 for
    4 (the hot loop has no spill: checked in the dumped assembly). AVX2 has 16 ymm,
    which 4 x 1 pairs of accumulators and the loads already use: one row at a time
    there. One x row at a time widens the weights again for every row, so a batched
    decode's cost grew with M (bench/RESULTS.md)."""
    return 4 if "avx512f" in host_cpu_features() else 1


def fits(k: int) -> bool:
    return k % LANES == 0


def executable_text(name: str, n: int, k: int, el: str = "f16", mb: int = 1) -> str:
    """`stream.executable @name` (templates/dense_avx2.mlir) whose export `@name` maps
    x [M, K] f32 and w [N, K] `el` (f16, i8; and for i8, scale [N] f32) to
    x @ f32(w)^T (* scale) [M, N] f32; `mb` rows of x share each widened weight vector
    (m_block)."""
    rpw, groups = split_rows(n, WORKGROUPS, ROWS)
    return render("dense_avx2", name=name, n=n, k=k, el=el, mb=mb, rows=ROWS, lanes=LANES,
                  groups=groups, rows_per_group=rpw,
                  prefetch_rows=PREFETCH_ROWS, stream_ahead=STREAM_AHEAD)


def emit(x: ir.Value, w: ir.Value, m_dim: ir.Value, n: int, k: int,
         scale: ir.Value | None = None) -> ir.Value:
    """y [M, N] f32 for x tensor<M x K x f32> (M static or dynamic; `m_dim` its index
    value) and w tensor<N x K x f16>, or w tensor<N x K x i8> with scale tensor<N x f32>,
    at the current insertion point."""
    el = "i8" if scale is not None else "f16"
    mb = m_block()
    name = f"tern_avx2_{el}_gemv_{n}x{k}"       # one m_block per host: one name
    ensure_executable(name, lambda: executable_text(name, n, k, el, mb))
    x_t = ir.RankedTensorType(x.type)
    dynamic = x_t.is_dynamic_dim(0)
    dims = [m_dim] if dynamic else []
    out_t = ir.RankedTensorType.get([x_t.get_dim_size(0) if not dynamic
                                     else ir.ShapedType.get_dynamic_size(), n], ir.F32Type.get())
    args = [x, w] + ([scale] if scale is not None else []) + [m_dim]
    return dispatch(name, name, [m_dim], args, dims, out_t, dims)


def emit_op(ctx, op, xs) -> list:
    """The kernel table's widening_matmul "avx2" row: `emit` on the op's x, w (f16, or i8
    with its row scale)."""
    x_t, w_t = (v.type for v in op.operands[:2])
    n, k = w_t.shape
    return [emit(xs[0], xs[1], ctx.dim(x_t.shape[0]), n, k, xs[2] if len(xs) == 3 else None)]
