"""The "blocked" prefill kernel: int8 activations times the ternary weights unpacked one
block of N rows at a time, so that no unpacked copy of the whole matrix ever exists.

    y = 0
    for n0 in range(0, N, NT):                        scf.for, in the module
        wt = unpack(packed[n0 : n0 + NT])             [NT, KP] i8, cache-sized
        y[:, n0 : n0 + NT] = xq @ wt^T                i8 x i8 -> i32, IREE's ukernel

IREE 3.13 never fuses an unpack into a matmul dispatch on CPU (shared/kernels/ pitfall
3), so each block is two dispatches: the unpack of NT x KP bytes (L2-resident) and the
data-tiled `linalg.matmul` that IREE lowers to its mmt4d ukernel. NT is chosen so that
the block holds about BLOCK_BYTES of int8 weights and there are few blocks: the
per-dispatch cost stays small next to the matmul.
"""
from __future__ import annotations

from iree.compiler import ir
from iree.compiler.dialects import linalg, scf, tensor

from ...codegen.builders import affine_map, const
from .builder import TernaryBuilder

#: int8 bytes of one unpacked block of weights (NT * KP).
BLOCK_BYTES = 2 << 20


def block_rows(n: int, kp: int) -> int:
    """NT: the largest divisor of N whose block of NT x KP int8 bytes fits BLOCK_BYTES
    (at least 1 row).

    >>> block_rows(4096, 4096), block_rows(2048, 2048), block_rows(7, 64)
    (512, 1024, 7)
    """
    best = 1
    for nt in range(1, n + 1):
        if n % nt == 0 and nt * kp <= BLOCK_BYTES:
            best = nt
    return best


def blocked(kern: TernaryBuilder) -> ir.Value:
    """y for int8-quantized x (act_quant), the weights unpacked NT rows at a time."""
    i8, i32, index = kern.i8, kern.i32, kern.index
    amax = kern.row_absmax()
    xq = kern.pad_k(kern.quantize(amax, i8))
    nt = block_rows(kern.n, kern.kp)
    # Pinned: with a single block, IREE would otherwise see unpack(constant) as a
    # constant expression and evaluate it at compile time into an unpacked copy.
    w = kern.pin_weights()
    acc_t = kern.ttype([kern.n], i32)
    loop = scf.ForOp(const(0, index), const(kern.n, index), const(nt, index),
                     [kern.empty([kern.n], i32)])
    with ir.InsertionPoint(loop.body):
        n0 = loop.induction_variable
        acc = loop.inner_iter_args[0]
        ws = tensor.extract_slice(ir.RankedTensorType.get([nt, kern.kb], i8), w, [n0], [], [],
                                  [ir.ShapedType.get_dynamic_stride_or_offset(), 0],
                                  [nt, kern.kb], [1, 1])
        wt = kern.unpack(i8, ws, nt)
        block_t = kern.ttype([nt], i32)
        zero = linalg.fill(const(0, i32), outs=[kern.empty([nt], i32)])
        yb = linalg.matmul(xq, wt, outs=[zero],
                           indexing_maps=[affine_map(3, [0, 2]), affine_map(3, [1, 2]), affine_map(3, [0, 1])])
        assert ir.RankedTensorType(yb.type) == block_t
        dyn = ir.ShapedType.get_dynamic_stride_or_offset()
        upd = tensor.insert_slice(yb, acc, [n0], kern.m_values, [], [0, dyn],
                                  [kern.m_static, nt], [1, 1])
        scf.YieldOp([upd])
    total = loop.results[0]
    assert ir.RankedTensorType(total.type) == acc_t
    return kern.dequant(total, amax)
