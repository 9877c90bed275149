"""The output layer of a language model on an AVX-512 VNNI host, for an int8 table with a
per-row f32 scale (nn.StoredTable "int8"): y[M, N] = x[M, K] @ W^T with x quantized to
int8 a row at a time, as the BitLinear layers quantize theirs (ternary_pack.act_quant:
roundeven(x * 127 / max(absmax, eps)), clipped to +-127), and the products summed
exactly in i32 by `vpdpbusd` (templates/dense_vnni.mlir):

    for a block of MB rows of x: quantize them into a stack buffer (every workgroup
    quantizes its own copy: MB x K values, ~0.1% of the products' work)
    for 2 weight rows at a time (one from each of 2 streams of the workgroup's rows),
    over K in 64-byte chunks:
        acc[r, m] += vpdpbusd(w[r, k:k+64] xor 0x80, xq[m, k:k+64])   (u8 w + 128, s8 xq)
    y[m, r] = scale[r] * amc_m / 127 * (sum(acc[r, m]) - 128 * sum_k xq[m, k])

Why: the widening kernel (widening_avx2) multiplies in f32 on int8 weights widened in
registers (`vpmovsxbd` + `vcvtdq2ps` + an FMA per 16 weights and row of x): at one row
of x it streams the table at the memory's rate, but at M = 8 (a batched decode step)
it costs ~3x its M = 1 time on the FMA ports. vpdpbusd does 64 multiply-adds an
instruction, so 8 rows cost about what the table's read costs.

Precision: the hidden state loses what int8 per-row quantization loses (a relative
step of absmax / 254 per element), on top of the int8 table's own rounding. On the
700M shape's table (32002 x 1536, random weights) and 256 probe hidden states (unit
Gaussians times the final norm's weight), the logits' cosine against the same table
with f32 x is >= 0.99993 and the top-1 token agrees on 252/256 (the int8 table itself
against the f32 table: 254/256); with heavy-tailed hidden states (Student t, 3 degrees
of freedom) 0.9966 and 244/256. Through a 700M generator (random ternary weights,
8 sequences of 128-token prompts, 16 steps fed the same tokens): cosine >= 0.99994
(mean 0.99997), top-1 equal on 126/128 (bench/RESULTS.md). The kernel table makes
it the int8 table's kernel where it fits: the int8 table is already the reduced-
precision choice (nn.stored.choose_table keeps float16 where int8 moves the top token).
Every row of x is quantized alone, so a sequence's logits do not depend on the batch.

M: rows of x in blocks of MB (2 x MB accumulators, no spill); one row left over runs
4 weight rows a step (a decode's GEMV); 2 to MB - 1 left over run as a block of MB whose
last rows are zero codes, not stored (the block costs about the table's read).
"""
from __future__ import annotations

from iree.compiler import ir

from ...codegen.executables import dispatch, ensure_executable, split_rows
from ..template import render
from ..ternary.avx2_quant import quant_literals

ROWS = 4
CHUNK = 64
PREFETCH_ROWS = 8
STREAM_AHEAD = 2
WORKGROUPS = 32
#: bytes of the per-workgroup buffer of quantized rows of x (MB x K): well within
#: IREE's 32 KiB stack limit
BUFFER_BYTES = 16384
MAX_K = 8192


def m_block(k: int) -> int:
    """Rows of x quantized and multiplied together: 8 (2 x 8 accumulators, 8 rows of x
    in registers: 26 zmm), fewer where 8 rows of K bytes would pass BUFFER_BYTES."""
    return max(2, min(8, BUFFER_BYTES // k))


def fits(k: int) -> bool:
    return k % CHUNK == 0 and k <= MAX_K


def executable_text(name: str, n: int, k: int) -> str:
    """`stream.executable @name` (templates/dense_vnni.mlir) whose export `@name` maps
    x [M, K] f32, w [N, K] i8 and scale [N] f32 to y [M, N] f32 (module docstring)."""
    rpw, groups = split_rows(n, WORKGROUPS, ROWS)
    return render("dense_vnni", name=name, n=n, k=k, mb=m_block(k), rows=ROWS,
                  groups=groups, rows_per_group=rpw, stream_ahead=STREAM_AHEAD,
                  prefetch_rows=PREFETCH_ROWS, **quant_literals())


def emit(x: ir.Value, w: ir.Value, scale: ir.Value, m_dim: ir.Value, n: int, k: int
         ) -> ir.Value:
    """y [M, N] f32 for x tensor<M x K x f32> (M static or dynamic; `m_dim` its index
    value), w tensor<N x K x i8> and scale tensor<N x f32>, at the current insertion
    point."""
    name = f"tern_vnni_i8_gemv_{n}x{k}"
    ensure_executable(name, lambda: executable_text(name, n, k))
    x_t = ir.RankedTensorType(x.type)
    dynamic = x_t.is_dynamic_dim(0)
    dims = [m_dim] if dynamic else []
    out_t = ir.RankedTensorType.get([x_t.get_dim_size(0) if not dynamic
                                     else ir.ShapedType.get_dynamic_size(), n], ir.F32Type.get())
    return dispatch(name, name, [m_dim], [x, w, scale, m_dim], dims, out_t, dims)


def emit_op(ctx, op, xs) -> list:
    """The kernel table's widening_matmul "avx512-vnni" row: `emit` on the op's x, w (i8)
    and its row scale."""
    x_t, w_t = (v.type for v in op.operands[:2])
    n, k = w_t.shape
    return [emit(xs[0], xs[1], xs[2], ctx.dim(x_t.shape[0]), n, k)]
