"""Activation quantization for the "avx2" ternary kernel (`avx2`): a row of x
quantized as `ternary_pack.act_quant` does (the macros of templates/avx2_quant_lib.mlir),
inside a kernel's own dispatch or by a dispatch of its own (`quantize_text`) whose codes
and row statistics every matmul of the same x reads (`quantized`).
"""
from __future__ import annotations

import numpy as np
from iree.compiler import ir

from ...ternary_pack import ACT_EPS, ACT_MAX
from ...codegen.executables import dispatch, ensure_executable
from ..template import render


def _f(v) -> str:
    """An f32 literal as MLIR reads it."""
    return f"{float(np.float32(v)):.9e}"


def quant_literals() -> dict:
    """The f32 literals of the quantization (eps, 127, its clip bounds) as the templates
    take them."""
    return {"eps": _f(ACT_EPS), "c127": _f(ACT_MAX), "lo": _f(-ACT_MAX), "hi": _f(ACT_MAX)}


#: Rows of x per workgroup of the quantize dispatch: 4, so a batched decode's 8 rows are
#: shared by two threads (kernels/rows/rows_cpu.py says what it measured).
QUANT_ROWS = 4


def quantize_text(name: str, kb: int, kx: int | None = None) -> str:
    """The `stream.executable @name` (templates/ternary_avx2_quant.mlir) whose export
    quantizes x [M, 4 KB] f32 once for every matmul that reads it: q [M, 4 KB] i8 (the
    codes) and stats [M, 2] f32 (the codes' sum, exact in f32 below 2^24, and max(amax,
    eps)), QUANT_ROWS rows a workgroup. `kx`: x is [M, kx] (kx < 4 KB, a multiple of 8),
    the codes zero from column kx on."""
    return render("ternary_avx2_quant", name=name, kb=kb, kx=kx, rows=QUANT_ROWS,
                  **quant_literals())


def unpadded(kern) -> bool:
    """Whether the quantize dispatch reads x [M, K] unpadded (K below the packed 4 KB, a
    multiple of 8) and writes the zero columns itself: no padded copy of x, which for a
    convolution's patch rows (K = 576 of 768 for 3x3x64) cost a dispatch as long as
    the quantization (bench/RESULTS.md)."""
    return kern.k != kern.kp and kern.k % 8 == 0


def quantized(kern, x: ir.Value, m: ir.Value, dims) -> list[ir.Value]:
    """[q, stats] of x from the quantize dispatch: the one already emitted for x in this
    block (matmuls that share an input, such as an attention block's q, k and v
    projections, share its quantization), else a new one. x is [M, 4 KB], or [M, K]
    where `unpadded(kern)`."""
    kx = int(ir.RankedTensorType(x.type).get_dim_size(1))
    kx = None if kx == 4 * kern.kb else kx
    qname = f"tern_avx2_quant_{kern.kb}" + (f"_x{kx}" if kx is not None else "")
    callee = ir.ArrayAttr.get([ir.SymbolRefAttr.get([qname, qname])])
    block = ir.InsertionPoint.current.block
    for use in x.uses:
        op = getattr(use.owner, "operation", use.owner)
        if (op.name == "flow.dispatch" and use.operand_number == 1      # after the workload
                and op.attributes["entry_points"] == callee and op.block == block):
            return list(op.results)
    ensure_executable(qname, lambda: quantize_text(qname, kern.kb, kx))
    return dispatch(qname, qname, [m], [x, m], dims,
                    [kern.ttype([4 * kern.kb], ir.IntegerType.get_signless(8)),
                     kern.ttype([2], kern.f32)], dims + dims)
