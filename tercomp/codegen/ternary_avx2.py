"""The "avx2" decode kernel: a hand-scheduled GEMV over the 2-bit constant, written as
vector code in a `stream.executable` that the ternary matmul dispatches to with
`flow.dispatch` (IREE compiles it like any dispatch, for the host CPU; no object file).

Why hand-scheduled: IREE's vectorizer turns the portable `addsub` kernel into about 70
instructions per 32 packed bytes on AVX2 (masks, selects, sign extensions), and the
`vnni` form into `vpmovzxbd` + `vpmaddwd` on 8 products at a time. Neither reaches the
memory limit at decode. This kernel is llama.cpp's TQ2_0 formulation (facts, not code):
per 32 packed bytes of a row,

    u  = (p & 0x55) + 0x55 - ((p >> 1) & 0x55)   every 2-bit code c (0, +1: 1, -1: 2)
                                                  becomes u = w + 1 in {0, 1, 2}
    s += vpmaddubsw((u >> 2j) & 3, x_j)           for the 4 planes j: u8 x s8 -> i16 pairs
    a += vpmaddwd(s, 1)                           i16 pairs -> i32 lanes

and y = (sum(a) - sum(x)) * scale * max|x| / 127 at the end (sum(w x) = sum(u x) - sum x).
Four output rows share each load of x; no horizontal add inside the K loop; each row's
next bytes are prefetched two row groups ahead; the rows are split into workgroups that
IREE's task system spreads over the cores.

Needs: llvm-cpu with AVX2, K/4 a multiple of 32 and N a multiple of 4 (the strategy
table's rule checks it; other shapes take `addsub`).
"""
from __future__ import annotations

import numpy as np
from iree.compiler import ir
from iree.compiler.dialects import arith

from ..ops.ternary_pack import ACT_EPS, ACT_MAX
from .executables import dispatch, ensure_executable

#: Output rows that share one pass over x.
ROWS = 4
#: Packed bytes per row that one vector covers (32 bytes: 128 weights).
CHUNK = 32
#: How many rows ahead each row's bytes are prefetched (two row groups). Without it one
#: core streamed ~5 GB/s; with it the 4096x4096 layer went from 0.41-0.60 ms to
#: 0.26-0.36 ms on the 2-core Zen 3 host (4, 8 and 16 rows ahead measured alike).
PREFETCH_ROWS = 8


#: The largest 4 KB: the quantized row lives on the dispatch's stack (IREE's limit 32 KiB)
MAX_KP = 16384
#: Workgroups per dispatch: each quantizes x itself, so few, but enough for both cores.
WORKGROUPS = 4


def fits(k_bytes: int, n: int) -> bool:
    """Whether the kernel takes a [N, KB] packed matrix."""
    return k_bytes % CHUNK == 0 and n % ROWS == 0 and 4 * k_bytes <= MAX_KP


def _rows_per_workgroup(n: int) -> int:
    """About WORKGROUPS workgroups, ROWS-aligned."""
    per = -(-n // WORKGROUPS)
    return max(ROWS, -(-per // ROWS) * ROWS)


def _f(v) -> str:
    """An f32 literal as MLIR reads it."""
    return f"{float(np.float32(v)):.9e}"


def _quantize_row(kp: int) -> str:
    """Quantize x[%mi, :] into %buf (i8 [KP]) as `ternary_pack.act_quant` does
    (roundeven(x * (127 / max(amax, eps))) clipped to +-127, in f32 and in that order, so
    the codes agree exactly); defines %sx (the sum of the codes) and %fm (the
    dequantization factor max(amax, eps) * scale / 127)."""
    vf, vi, vb = "vector<8xf32>", "vector<8xi32>", "vector<8xi8>"
    xt = f"memref<?x{kp}xf32>"
    return f"""
          %amv = scf.for %k = %c0 to %ckp step %c8 iter_args(%a = %zf8) -> ({vf}) {{
            %v = vector.load %x[%mi, %k] : {xt}, {vf}
            %av = math.absf %v : {vf}
            %an = arith.maximumf %a, %av : {vf}
            scf.yield %an : {vf}
          }}
          %amax = vector.reduction <maximumf>, %amv : {vf} into f32
          %amc = arith.maximumf %amax, %eps : f32
          %qs = arith.divf %c127, %amc : f32
          %qsv = vector.broadcast %qs : f32 to {vf}
          %sxv = scf.for %k = %c0 to %ckp step %c8 iter_args(%a = %zi8) -> ({vi}) {{
            %v = vector.load %x[%mi, %k] : {xt}, {vf}
            %sc = arith.mulf %v, %qsv : {vf}
            %rd = math.roundeven %sc : {vf}
            %lo = arith.maximumf %rd, %lov : {vf}
            %cl = arith.minimumf %lo, %hiv : {vf}
            %qi = arith.fptosi %cl : {vf} to {vi}
            %qb = arith.trunci %qi : {vi} to {vb}
            vector.store %qb, %buf[%k] : memref<{kp}xi8>, {vb}
            %an = arith.addi %a, %qi : {vi}
            scf.yield %an : {vi}
          }}
          %sx = vector.reduction <add>, %sxv : {vi} into i32
          %fm = arith.mulf %amc, %wscale : f32"""


def executable_text(name: str, n: int, kb: int) -> str:
    """The `stream.executable @name` whose export `@name` computes, for x [M, 4 KB] f32
    (K zero-padded to 4 KB), w [N, KB] i8 packed and `wscale` (the ternary scale / 127),
    out [M, N] f32 = dequant(act_quant(x) @ T^T), T the ternary matrix of w. Each
    workgroup quantizes x itself (a few microseconds) rather than leaving it to four
    dispatches of their own, each of which costs a task-system round trip."""
    kp, rpw = 4 * kb, _rows_per_workgroup(n)
    groups = -(-n // rpw)
    v8, v16, v32 = "vector<32xi8>", "vector<16xi16>", "vector<8xi32>"
    bt, wt, ot = f"memref<{kp}xi8>", f"memref<{n}x{kb}xi8>", f"memref<?x{n}xf32>"
    mad = 'llvm.call_intrinsic "llvm.x86.avx2.pmadd.ub.sw"'
    madw = 'llvm.call_intrinsic "llvm.x86.avx2.pmadd.wd"'

    body = []
    for i in range(ROWS):
        body += [
            f"%row{i} = affine.apply affine_map<(d0) -> (d0 + {i})>(%r)",
            f"%raw{i} = vector.load %w[%row{i}, %c] : {wt}, {v8}",
            # past the last row this computes an address in no row: x86 prefetches
            # never fault
            f"%pre{i} = affine.apply affine_map<(d0) -> (d0 + {PREFETCH_ROWS})>(%row{i})",
            f"memref.prefetch %w[%pre{i}, %c], read, locality<0>, data : {wt}",
            f"%lo{i} = arith.andi %raw{i}, %m55 : {v8}",
            f"%hs{i} = arith.shrui %raw{i}, %s1 : {v8}",
            f"%hi{i} = arith.andi %hs{i}, %m55 : {v8}",
            f"%lp{i} = arith.addi %lo{i}, %m55 : {v8}",
            f"%u{i} = arith.subi %lp{i}, %hi{i} : {v8}",
        ]
        for j in range(4):
            if j == 0:
                code = f"%q{i}_{j} = arith.andi %u{i}, %three : {v8}"
            elif j < 3:
                code = (f"%t{i}_{j} = arith.shrui %u{i}, %s{2 * j} : {v8}\n"
                        f"%q{i}_{j} = arith.andi %t{i}_{j}, %three : {v8}")
            else:
                code = f"%q{i}_{j} = arith.shrui %u{i}, %s6 : {v8}"
            body += [code, f"%e{i}_{j} = {mad}(%q{i}_{j}, %x{j}) : ({v8}, {v8}) -> {v16}"]
        body += [
            f"%f{i}a = arith.addi %e{i}_0, %e{i}_1 : {v16}",
            f"%f{i}b = arith.addi %e{i}_2, %e{i}_3 : {v16}",
            f"%g{i} = arith.addi %f{i}a, %f{i}b : {v16}",
            f"%h{i} = {madw}(%g{i}, %ones16) : ({v16}, {v16}) -> {v32}",
            f"%n{i} = arith.addi %a{i}, %h{i} : {v32}",
        ]
    x_loads = [f"%xo{j} = affine.apply affine_map<(d0) -> (d0 + {j * kb})>(%c)\n"
               f"%x{j} = vector.load %buf[%xo{j}] : {bt}, {v8}" for j in range(4)]
    accs = ", ".join(f"%a{i} = %z32" for i in range(ROWS))
    acc_types = ", ".join([v32] * ROWS)
    yields = ", ".join(f"%n{i}" for i in range(ROWS))
    stores = []
    for i in range(ROWS):
        stores += [
            f"%red{i} = vector.reduction <add>, %acc#{i} : {v32} into i32",
            f"%dif{i} = arith.subi %red{i}, %sx : i32",
            f"%flt{i} = arith.sitofp %dif{i} : i32 to f32",
            f"%y{i} = arith.mulf %flt{i}, %fm : f32",
            f"%orow{i} = affine.apply affine_map<(d0) -> (d0 + {i})>(%r)",
            f"memref.store %y{i}, %o[%mi, %orow{i}] : {ot}",
        ]
    nl = "\n"
    return f"""
stream.executable private @{name} {{
  stream.executable.export public @{name} workgroups(%m: index) -> (index, index, index) {{
    %c1 = arith.constant 1 : index
    %g = arith.constant {groups} : index
    stream.return %g, %c1, %c1 : index, index, index
  }}
  builtin.module {{
    func.func @{name}(%bx: !stream.binding, %bw: !stream.binding, %bo: !stream.binding,
                    %wscale: f32, %m: index) {{
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %c8 = arith.constant 8 : index
      %cr = arith.constant {ROWS} : index
      %cc = arith.constant {CHUNK} : index
      %ckb = arith.constant {kb} : index
      %ckp = arith.constant {kp} : index
      %cn = arith.constant {n} : index
      %rpw = arith.constant {rpw} : index
      %eps = arith.constant {_f(ACT_EPS)} : f32
      %c127 = arith.constant {_f(ACT_MAX)} : f32
      %lov = arith.constant dense<{_f(-ACT_MAX)}> : vector<8xf32>
      %hiv = arith.constant dense<{_f(ACT_MAX)}> : vector<8xf32>
      %zf8 = arith.constant dense<0.0> : vector<8xf32>
      %zi8 = arith.constant dense<0> : vector<8xi32>
      %x = stream.binding.subspan %bx[%c0] : !stream.binding -> memref<?x{kp}xf32>{{%m}}
      %w = stream.binding.subspan %bw[%c0] : !stream.binding -> {wt}
      %o = stream.binding.subspan %bo[%c0] : !stream.binding -> {ot}{{%m}}
      %buf = memref.alloca() : {bt}
      %wg = stream.dispatch.workgroup.id[0] : index
      %r0 = arith.muli %wg, %rpw : index
      %r1u = arith.addi %r0, %rpw : index
      %r1 = arith.minui %r1u, %cn : index
      %three = arith.constant dense<3> : {v8}
      %m55 = arith.constant dense<85> : {v8}
      %s1 = arith.constant dense<1> : {v8}
      %s2 = arith.constant dense<2> : {v8}
      %s4 = arith.constant dense<4> : {v8}
      %s6 = arith.constant dense<6> : {v8}
      %ones16 = arith.constant dense<1> : {v16}
      %z32 = arith.constant dense<0> : {v32}
      scf.for %mi = %c0 to %m step %c1 {{{_quantize_row(kp)}
        scf.for %r = %r0 to %r1 step %cr {{
          %acc:{ROWS} = scf.for %c = %c0 to %ckb step %cc iter_args({accs}) -> ({acc_types}) {{
            {nl.join(x_loads)}
            {nl.join(body)}
            scf.yield {yields} : {acc_types}
          }}
          {nl.join(stores)}
        }}
      }}
      return
    }}
  }}
}}
"""


def emit(kern) -> ir.Value:
    """y [M, N] f32 for the `_Kernel` `kern` (activation quantization always on)."""
    name = f"tern_avx2_gemv_{kern.n}x{kern.kb}"
    ensure_executable(name, lambda: executable_text(name, kern.n, kern.kb))
    m = kern.m_values[0] if kern.m_values else arith.constant(kern.index, kern.m)
    dims = list(kern.m_values)
    # the scale is an operand, not a constant of the executable: every layer of a shape
    # shares one executable
    wscale = arith.constant(kern.f32, float(np.float32(kern.scale / ACT_MAX)))
    return dispatch(name, name, [m], [kern.pad_k(kern.x), kern.pin_weights(), wscale, m],
                    dims, kern.ttype([kern.n], kern.f32), dims)
