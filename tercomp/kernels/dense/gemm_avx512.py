"""f32 GEMMs on an AVX-512 host, for a batch of matrices that share one operand or whose
products are summed: the convolutions' f32 matmuls of a training step (BitConv's
backward: the input's cotangent W^T @ g [B, C * K, P] and the weight's, a sum over the
images), which IREE 3.13's codegen ran at 25-45 GFLOP/s on the 2-core Xeon VM without
data tiling (its data tiling does not take a batched matmul with a broadcast operand).

    shared: c[b] = a @ x[b]            a [M, K] f32, x [B, K, N], c [B, M, N]
    sum:    c = sum_b a[b] @ x[b]      a [B, M, K], x [B, K, N], c [M, N]

A plain product a [M, K] @ x [K, N] (an MLP's training step: g @ W and g^T @ x of its
backward) is the shared form with B = 1. Not x @ W^T (a Linear's forward): a constant W
would be copied transposed, and IREE's compile evaluated that copy (a static-shape LM's
32000-row output layer: its test's compile 5 -> 15 s).

templates/gemm_avx512.mlir: x's rows are in the vector lanes (16 columns a vector), a's
elements broadcast (one vfmadd231ps with a {1to16} memory operand per element and
vector); tiles of MR rows x NV vectors of accumulators over chunks of KC of K, the
chunk of x (KC x a workgroup's columns) reused from L1 by every row tile. The
64 x 576 x 1024 product over 32 images (the 64-channel 3x3 layer's) took 14-15 ms (about
170 GFLOP/s on 2 threads) against 28-33 ms without the K chunks and 56-66 ms for IREE's
dispatch in the step (bench/RESULTS.md).
"""
from __future__ import annotations

from iree.compiler import ir
from iree.compiler.dialects import tensor

from ...codegen.builders import PARALLEL, affine_map, index_const
from ...codegen.executables import dispatch, ensure_executable
from ...ir import TensorType
from ..template import render

LANES = 16
#: Accumulator tiles: MR rows x NV vectors of 16 columns (16 of the 32 zmm registers).
MR, NV = 8, 2
#: Rows a tile where N is one vector (16 columns: a 4x4 image's positions).
MR_NARROW = 16
#: Columns a workgroup (at most; N itself where it is smaller).
NW = 64
#: The chunk of K whose rows of x stay in L1 (96 x 64 floats: 24 KiB).
KC_MAX = 96
#: Rows a workgroup of the summed form takes, at most.
MB_MAX = 64
#: Below this many multiply-adds the op keeps IREE's lowering: each executable costs
#: about 0.3-0.5 s of compile, and at 2^22 (an MLP of 256 at batch 64) the kernel and
#: the transposes around it were alike or slower than IREE's dispatch (bench/RESULTS.md).
MIN_MACS = 1 << 24


def tiles(m: int, k: int, n: int) -> tuple[int, int, int, int] | None:
    """(mr, nv, nw, kc) for an M x K x N product, or None where this kernel does not
    take it (N not a multiple of 16, M not of the tile's rows)."""
    if n % LANES:
        return None
    nv = NV if n % (LANES * NV) == 0 else 1
    mr = MR if nv == NV else MR_NARROW
    while mr > 1 and m % mr:
        mr //= 2
    nw = min(n, NW)
    while n % nw or nw % (LANES * nv):
        nw -= LANES
    kc = next((c for c in range(min(k, KC_MAX), 0, -1) if k % c == 0), k)
    return mr, nv, nw, kc


def fits(batch: int, m: int, k: int, n: int) -> bool:
    return tiles(m, k, n) is not None and batch * m * k * n >= MIN_MACS


def _row_block(m: int, mr: int, groups_along_n: int) -> int:
    """Rows a workgroup of the summed form: a multiple of mr dividing m, at most MB_MAX,
    and small enough for 8 workgroups where m allows."""
    best = mr
    for mb in range(mr, min(m, MB_MAX) + 1, mr):
        if m % mb == 0 and (m // mb) * groups_along_n >= 8:
            best = mb
    return best


def executable_text(name: str, mode: str, batch: int, m: int, k: int, n: int) -> str:
    mr, nv, nw, kc = tiles(m, k, n)
    mb = _row_block(m, mr, n // nw) if mode == "sum" else m
    return render("gemm_avx512", name=name, mode=mode, batch=batch, m=m, k=k, n=n, mr=mr,
                  nv=nv, nw=nw, mb=mb, kc=kc)


def emit(a: ir.Value, x: ir.Value, mode: str) -> ir.Value:
    """c for a (tensor [M, K] shared, or [B, M, K] summed) and x tensor [B, K, N], all
    static f32, at the current insertion point."""
    xt = ir.RankedTensorType(x.type)
    at = ir.RankedTensorType(a.type)
    batch, k, n = (xt.get_dim_size(i) for i in range(3))
    m = at.get_dim_size(at.rank - 2)
    name = f"tern_gemm_avx512_{mode}_{batch}x{m}x{k}x{n}"
    ensure_executable(name, lambda: executable_text(name, mode, batch, m, k, n))
    shape = [batch, m, n] if mode == "shared" else [m, n]
    out_t = ir.RankedTensorType.get(shape, ir.F32Type.get())
    one = index_const(1)
    return dispatch(name, name, [one], [a, x, one], [], out_t, [])


def _transposed(ctx, v: ir.Value, shape) -> ir.Value:
    """v [B, R, C] (static f32) as [B, C, R]: a copy generic."""
    bt, r, c = shape
    return ctx.generic([v], [affine_map(3, [0, 2, 1])], TensorType((bt, c, r), "f32"),
                       affine_map(3, [0, 1, 2]), [PARALLEL] * 3, lambda x, acc: x)


def emit_shared_op(ctx, op, xs) -> list:
    """The kernel table's matmul "avx512-f32" row: a [M, K] @ x [B, K, N], or a plain
    matrix product a [M, K] @ x [K, N] as a batch of one."""
    a_t, x_t = (v.type for v in op.operands)
    if x_t.rank == 3:
        return [emit(xs[0], xs[1], "shared")]
    x = xs[1]
    k, n = (int(d) for d in x_t.shape)
    m = int(a_t.shape[0])
    f32 = ir.F32Type.get()
    x3 = tensor.ExpandShapeOp(ir.RankedTensorType.get([1, k, n], f32), x, [[0, 1], [2]], [],
                              [1, k, n]).result
    c = emit(xs[0], x3, "shared")
    return [tensor.CollapseShapeOp(ir.RankedTensorType.get([m, n], f32), c, [[0, 1], [2]]).result]


def emit_sum_op(ctx, op, xs) -> list:
    """The kernel table's matmul_sum "avx512-f32" row: sum_b a[b] @ x[b]^T for a [B, M, N]
    and x [B, K, N], as (sum_b x[b] @ a[b]^T)^T: x's rows are the kernel's broadcast
    operand (their N contiguous), a transposed to [B, N, M] its vector operand, and the
    [K, M] result transposed back (both transposes a small fraction of x's bytes: M is
    a layer's output channels, K its patch length)."""
    bt, m, n = (int(d) for d in op.operands[0].type.shape)
    k = int(op.operands[1].type.shape[1])
    c = emit(xs[1], _transposed(ctx, xs[0], (bt, m, n)), "sum")               # [K, M]
    return [ctx.generic([c], [affine_map(2, [1, 0])], TensorType((m, k), "f32"),
                        affine_map(2, [0, 1]), [PARALLEL] * 2, lambda v, acc: v)]
