"""Activation quantization for the "avx2" ternary kernel (`ternary_avx2`), as MLIR text:
a row of x quantized as `ternary_pack.act_quant` does, inside a kernel's own dispatch or
by a dispatch of its own (`quantize_text`) whose codes and row statistics every matmul
of the same x reads (`quantized`).
"""
from __future__ import annotations

import numpy as np
from iree.compiler import ir

from ..ternary_pack import ACT_EPS, ACT_MAX
from .executables import dispatch, ensure_executable
from .executables import executable_text as wrap_executable


def _f(v) -> str:
    """An f32 literal as MLIR reads it."""
    return f"{float(np.float32(v)):.9e}"


def quantize_row(kp: int, b: int, row: str, dst: str, dst_row: str, dst_type: str) -> str:
    """Quantize x[row, :] into dst[dst_row, :] (i8) as `ternary_pack.act_quant` does
    (roundeven(x * (127 / max(amax, eps))) clipped to +-127, in f32 and in that order, so
    the codes agree exactly); defines %sx{b} (the sum of the codes, i32) and %amc{b}
    (max(amax, eps): the codes times amc / 127 are x's approximation)."""
    vf, vi, vb = "vector<8xf32>", "vector<8xi32>", "vector<8xi8>"
    xt = f"memref<?x{kp}xf32>"
    return f"""
          %amv{b} = scf.for %k = %c0 to %ckp step %c8 iter_args(%a = %zf8) -> ({vf}) {{
            %v = vector.load %x[{row}, %k] : {xt}, {vf}
            %av = math.absf %v : {vf}
            %an = arith.maximumf %a, %av : {vf}
            scf.yield %an : {vf}
          }}
          %amax{b} = vector.reduction <maximumf>, %amv{b} : {vf} into f32
          %amc{b} = arith.maximumf %amax{b}, %eps : f32
          %qs{b} = arith.divf %c127, %amc{b} : f32
          %qsv{b} = vector.broadcast %qs{b} : f32 to {vf}
          %sxv{b} = scf.for %k = %c0 to %ckp step %c8 iter_args(%a = %zi8) -> ({vi}) {{
            %v = vector.load %x[{row}, %k] : {xt}, {vf}
            %sc = arith.mulf %v, %qsv{b} : {vf}
            %rd = math.roundeven %sc : {vf}
            %lo = arith.maximumf %rd, %lov : {vf}
            %cl = arith.minimumf %lo, %hiv : {vf}
            %qi = arith.fptosi %cl : {vf} to {vi}
            %qb = arith.trunci %qi : {vi} to {vb}
            vector.store %qb, {dst}[{dst_row}, %k] : {dst_type}, {vb}
            %an = arith.addi %a, %qi : {vi}
            scf.yield %an : {vi}
          }}
          %sx{b} = vector.reduction <add>, %sxv{b} : {vi} into i32"""


def row_stats(b: int, row: str) -> str:
    """%sx{b} and %fm{b} (the dequantization factor amc * scale / 127) of quantized row
    `row` of x, from the quantize dispatch's statistics (%xs [M, 2]: sum, amc)."""
    return f"""
          %sxf{b} = memref.load %xs[{row}, %c0] : memref<?x2xf32>
          %sx{b} = arith.fptosi %sxf{b} : f32 to i32
          %amc{b} = memref.load %xs[{row}, %c1] : memref<?x2xf32>
          %fm{b} = arith.mulf %amc{b}, %wscale : f32"""


_COMMON = """      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
{consts}
      %c8 = arith.constant 8 : index
      %ckp = arith.constant {kp} : index
      %eps = arith.constant {eps} : f32
      %c127 = arith.constant {c127} : f32
      %lov = arith.constant dense<{lo}> : vector<8xf32>
      %hiv = arith.constant dense<{hi}> : vector<8xf32>
      %zf8 = arith.constant dense<0.0> : vector<8xf32>
      %zi8 = arith.constant dense<0> : vector<8xi32>"""


def common(kp: int, n_index: int) -> str:
    """The constants the quantization and the kernels use (index constants 0 ..
    n_index - 1 among them)."""
    return _COMMON.format(
        consts="\n".join(f"      %c{b} = arith.constant {b} : index" for b in range(2, n_index)),
        kp=kp, eps=_f(ACT_EPS), c127=_f(ACT_MAX), lo=_f(-ACT_MAX), hi=_f(ACT_MAX))


#: Rows of x per workgroup of the quantize dispatch.
QUANT_ROWS = 8


def quantize_text(name: str, kb: int) -> str:
    """The `stream.executable @name` whose export quantizes x [M, 4 KB] f32 once for
    every matmul that reads it: q [M, 4 KB] i8 (the codes) and stats [M, 2] f32 (the
    codes' sum, exact in f32 below 2^24, and max(amax, eps)), QUANT_ROWS rows a
    workgroup."""
    kp = 4 * kb
    qt = f"memref<?x{kp}xi8>"
    body = f"""{common(kp, 2)}
      %crows = arith.constant {QUANT_ROWS} : index
      %x = stream.binding.subspan %bx[%c0] : !stream.binding -> memref<?x{kp}xf32>{{%m}}
      %q = stream.binding.subspan %bq[%c0] : !stream.binding -> {qt}{{%m}}
      %xs = stream.binding.subspan %bs[%c0] : !stream.binding -> memref<?x2xf32>{{%m}}
      %wg = stream.dispatch.workgroup.id[0] : index
      %row0 = arith.muli %wg, %crows : index
      %row1u = arith.addi %row0, %crows : index
      %row1 = arith.minui %row1u, %m : index
      scf.for %row = %row0 to %row1 step %c1 {{{quantize_row(kp, 0, "%row", "%q", "%row", qt)}
        %sxf0 = arith.sitofp %sx0 : i32 to f32
        memref.store %sxf0, %xs[%row, %c0] : memref<?x2xf32>
        memref.store %amc0, %xs[%row, %c1] : memref<?x2xf32>
      }}"""
    return wrap_executable(name, None, "%bx: !stream.binding, %bq: !stream.binding, "
                           "%bs: !stream.binding, %m: index", body, per_group=QUANT_ROWS)


def quantized(kern, x: ir.Value, m: ir.Value, dims) -> list[ir.Value]:
    """[q, stats] of x from the quantize dispatch: the one already emitted for x in this
    block (matmuls that share an input, such as an attention block's q, k and v
    projections, share its quantization), else a new one."""
    qname = f"tern_avx2_quant_{kern.kb}"
    callee = ir.ArrayAttr.get([ir.SymbolRefAttr.get([qname, qname])])
    block = ir.InsertionPoint.current.block
    for use in x.uses:
        op = getattr(use.owner, "operation", use.owner)
        if (op.name == "flow.dispatch" and use.operand_number == 1      # after the workload
                and op.attributes["entry_points"] == callee and op.block == block):
            return list(op.results)
    ensure_executable(qname, lambda: quantize_text(qname, kern.kb))
    return dispatch(qname, qname, [m], [x, m], dims,
                    [kern.ttype([4 * kern.kb], ir.IntegerType.get_signless(8)),
                     kern.ttype([2], kern.f32)], dims + dims)
