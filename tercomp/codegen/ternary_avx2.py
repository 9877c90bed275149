"""The "avx2" ternary matmul kernel: hand-scheduled vector code over the 2-bit constant
for every batch size (a GEMV loop for single rows of x, a GEMM loop for blocks of MB
rows), written as a `stream.executable` that the ternary matmul dispatches to with
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
The GEMV loop decodes with one shift instead of three: planes 0 and 2 are u & 3 and
(u >> 4) & 3, planes 1 and 3 are left 4 times their codes (u & 12, (u >> 4) & 12) and
summed apart, and the i32 sums hold 4 times the dot product until the end.
In the GEMV loop four output rows share each load of x, one from each quarter of the
workgroup's rows, so each of the four reads its quarter as one stream (far-apart
streams keep more DRAM reads in flight than adjacent rows: see STREAM_AHEAD); in the
GEMM loop each decoded weight chunk meets MB rows of x. Both sum the i16 pairs over
several chunks before one `vpmaddwd`. No horizontal add inside the K loop; the rows are
split into workgroups that IREE's task system spreads over the cores; each workgroup
quantizes x itself.

Needs: llvm-cpu with AVX2, K/4 a multiple of 32 and N a multiple of 4 (the strategy
table's rule checks it; other shapes take `addsub`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from iree.compiler import ir
from iree.compiler.dialects import arith

from ..ternary_pack import ACT_MAX
from .executables import dispatch, ensure_executable, load_row
from .executables import executable_text as wrap_executable
from .ternary_avx2_quant import common, quantize_row, quantized, row_stats

#: Output rows that share one pass over x.
ROWS = 4
#: Packed bytes per row that one vector covers (32 bytes: 128 weights).
CHUNK = 32
#: How many rows ahead the GEMM loop prefetches each row's bytes (two row groups).
#: Without it one core streamed ~5 GB/s; with it the 4096x4096 layer went from 0.41-0.60
#: ms to 0.26-0.36 ms on the 2-core Zen 3 host (4, 8 and 16 rows ahead measured alike).
PREFETCH_ROWS = 8
#: The GEMV loop reads its ROWS rows from ROWS streams, one per quarter of the
#: workgroup's rows, each prefetched into L1 this many rows ahead. Far-apart streams keep
#: more DRAM reads in flight than adjacent rows do: on the 2-core Zen 3 VM a plain read
#: went from ~24 GB/s with one or two streams per core to ~37-41 GB/s with four to
#: eight, and a C model of this loop over 16 cold 4096x4096 layers from ~210 us a layer
#: (adjacent rows, prefetchnta 8 rows ahead) to ~105-125 us. In IREE, 16 cold layers
#: chained at M = 1, both kernels loaded twice in one process in both orders, median /
#: min per layer: 0.10x-0.12x / 0.08x-0.10x NumPy's with streams, 0.15x-0.20x /
#: 0.13x-0.15x with adjacent rows (2026-11-24). One or four rows ahead measured alike.
STREAM_AHEAD = 2


#: Rows of x quantized and multiplied together in the GEMM loop (M >= MB).
MB = 4
#: Weight rows decoded per GEMM step (GEMM_ROWS x MB i16 and i32 accumulators). One row
#: keeps its 4 code planes and the MB i16 sums in registers; two rows (8 + 8 vectors of
#: AVX2's 16) spilled: at 128x4096x4096, 0.20x NumPy's median with one row against 0.29x
#: with two, at 128x2048x2048 0.20x against 0.27x (2026-11-24, 2-core Zen 3 under load;
#: 8 rows of x with one weight row measured 0.17x-0.27x, within the noise of 4).
GEMM_ROWS = 1
#: Chunks summed in i16 before widening in the GEMM loop (16 * 4 planes * 508 < 32767).
I16_CHUNKS = 16
#: The same for the GEMV loop's sums of planes 1 and 3, which are 4 times their codes
#: (8 chunks * 2 planes * 2 * 8 * 127 = 32512 <= 32767).
GEMV_I16_CHUNKS = 8
#: The largest 4 KB: MB quantized rows live on the dispatch's stack (MB * MAX_KP bytes;
#: the strategy raises IREE's 32 KiB stack limit to STACK_LIMIT).
MAX_KP = 8192
STACK_LIMIT = 65536
#: Workgroups per dispatch: few (where a workgroup quantizes x itself, a static decode,
#: every extra one quantizes x once more), but enough for both cores and, for a block of
#: rows (M >= MB), to even out a core that the host takes away: at
#: 128x4096x4096, 8 gave 0.44x NumPy's median against 0.60x with 4 (2026-11-24, 2-core
#: Zen 3 VM with ~50% steal time). Decode (M = 1) measured the same with either at
#: 4096x4096, and every extra workgroup quantizes x once more, so M < MB gets 4.
#: (16 workgroups, 256 KiB of weights each, measured alike with 8 at 128x4096x4096.)
WORKGROUPS = 8
DECODE_WORKGROUPS = 4


def fits(k_bytes: int, n: int) -> bool:
    """Whether the kernel takes a [N, KB] packed matrix."""
    return k_bytes % CHUNK == 0 and n % ROWS == 0 and 4 * k_bytes <= MAX_KP


_V8, _V16, _V32 = "vector<32xi8>", "vector<16xi16>", "vector<8xi32>"
_MAD = 'llvm.call_intrinsic "llvm.x86.avx2.pmadd.ub.sw"'
_MADW = 'llvm.call_intrinsic "llvm.x86.avx2.pmadd.wd"'


def _codes(i, wt: str, offset: bool, col: str = "%c", prefetch: bool = True,
           scaled: bool = False, base: str | None = None) -> list[str]:
    """Load 32 packed bytes of weight row %r + i (or of row `base`, a row of its own
    stream, prefetched STREAM_AHEAD rows ahead into L1) at column `col` (prefetching the
    row PREFETCH_ROWS ahead) and define %q{i}_{j}, its u = w + 1 codes of plane j (`i`
    may carry a suffix naming the chunk). The bytes hold u already when `offset`, else
    the signed codes, remapped here. `scaled`: planes 1 and 3 are left 4 times their
    codes (u & 0xC and (u >> 4) & 0xC), which saves two shifts: one shift serves planes
    2 and 3, none is needed for 0 and 1."""
    v8, row = _V8, int(str(i).split("_")[0])
    if base is None:
        raw = f"%raw{i}_{row}"
        lines = load_row(f"raw{i}_", row, "%r", col, "%w", wt, v8, PREFETCH_ROWS, prefetch)
    else:
        raw = f"%raw{i}_0"
        lines = load_row(f"raw{i}_", 0, base, col, "%w", wt, v8, STREAM_AHEAD, prefetch,
                         locality=3)
    u = raw if offset else f"%u{i}"
    if not offset:
        lines += [
            f"%lo{i} = arith.andi {raw}, %m55 : {v8}",
            f"%hs{i} = arith.shrui {raw}, %s1 : {v8}",
            f"%hi{i} = arith.andi %hs{i}, %m55 : {v8}",
            f"%lp{i} = arith.addi %lo{i}, %m55 : {v8}",
            f"%u{i} = arith.subi %lp{i}, %hi{i} : {v8}",
        ]
    if scaled:
        return lines + [
            f"%q{i}_0 = arith.andi {u}, %three : {v8}",
            f"%q{i}_1 = arith.andi {u}, %twelve : {v8}",
            f"%t{i}_2 = arith.shrui {u}, %s4 : {v8}",
            f"%q{i}_2 = arith.andi %t{i}_2, %three : {v8}",
            f"%q{i}_3 = arith.andi %t{i}_2, %twelve : {v8}",
        ]
    return lines + [
        f"%q{i}_0 = arith.andi {u}, %three : {v8}",
        f"%t{i}_1 = arith.shrui {u}, %s2 : {v8}",
        f"%q{i}_1 = arith.andi %t{i}_1, %three : {v8}",
        f"%t{i}_2 = arith.shrui {u}, %s4 : {v8}",
        f"%q{i}_2 = arith.andi %t{i}_2, %three : {v8}",
        f"%q{i}_3 = arith.shrui {u}, %s6 : {v8}",
    ]


@dataclass(frozen=True)
class _XRows:
    """Where the loops read quantized rows of x: `mem` (of type `type`), the block's row
    b at index `rows[b]`."""
    mem: str
    type: str
    rows: tuple


def _x_planes(b: int, kb: int, xs: _XRows, col: str = "%c") -> list[str]:
    """%x{b}_{j}: the 32 quantized x values of plane j at column `col` of row b."""
    return [f"%xo{b}_{j} = affine.apply affine_map<(d0) -> (d0 + {j * kb})>({col})\n"
            f"%x{b}_{j} = vector.load {xs.mem}[{xs.rows[b]}, %xo{b}_{j}] : {xs.type}, {_V8}"
            for j in range(4)]


def _stores(pairs, ot: str, acc: str, quarter: bool = False, rows=None) -> list[str]:
    """y[m + b, r + i] (or y[m + b, rows[i]]) = (sum(acc) - sx{b}) * fm{b} for each
    (i, b) of `pairs`; the accumulators are %{acc}#0, #1, ... in that order (`quarter`:
    they hold 4 times the sum, exactly)."""
    out = []
    for n, (i, b) in enumerate(pairs):
        if quarter:
            out += [f"%red4{i}_{b} = vector.reduction <add>, %{acc}#{n} : {_V32} into i32",
                    f"%red{i}_{b} = arith.shrsi %red4{i}_{b}, %c2i32 : i32"]
        else:
            out.append(f"%red{i}_{b} = vector.reduction <add>, %{acc}#{n} : {_V32} into i32")
        row = f"%orow{i}_{b}" if rows is None else rows[i]
        if rows is None:
            out.append(f"{row} = affine.apply affine_map<(d0) -> (d0 + {i})>(%r)")
        out += [
            f"%dif{i}_{b} = arith.subi %red{i}_{b}, %sx{b} : i32",
            f"%flt{i}_{b} = arith.sitofp %dif{i}_{b} : i32 to f32",
            f"%y{i}_{b} = arith.mulf %flt{i}_{b}, %fm{b} : f32",
            f"%ocol{i}_{b} = affine.apply affine_map<(d0) -> (d0 + {b})>(%mrow)",
            f"memref.store %y{i}_{b}, %o[%ocol{i}_{b}, {row}] : {ot}",
        ]
    return out


def _products(tag: str, codes: str, x: str) -> list[str]:
    """%e{tag}_j: vpmaddubsw of the codes %{codes}_j with the quantized x %{x}_j (the i16
    pair sums of one chunk) for the 4 planes j."""
    return [f"%e{tag}_{j} = {_MAD}(%{codes}_{j}, %{x}_{j}) : ({_V8}, {_V8}) -> {_V16}"
            for j in range(4)]


def _dot_chunk(tag: str, codes: str, x: str, acc: str) -> list[str]:
    """%n{tag} = acc + the `_products` of one chunk, the 4 planes added together."""
    return _products(tag, codes, x) + [
        f"%f{tag}a = arith.addi %e{tag}_0, %e{tag}_1 : {_V16}",
        f"%f{tag}b = arith.addi %e{tag}_2, %e{tag}_3 : {_V16}",
        f"%g{tag} = arith.addi %f{tag}a, %f{tag}b : {_V16}",
        f"%n{tag} = arith.addi {acc}, %g{tag} : {_V16}",
    ]


def _dot_chunk_scaled(tag: str, codes: str, x: str, lo: str, hi: str) -> list[str]:
    """As `_dot_chunk` for `_codes(scaled=True)`: %l{tag} = lo + the pair sums of planes 0
    and 2, %h{tag} = hi + those of planes 1 and 3 (4 times their codes)."""
    return _products(tag, codes, x) + [
        f"%f{tag}a = arith.addi %e{tag}_0, %e{tag}_2 : {_V16}",
        f"%l{tag} = arith.addi {lo}, %f{tag}a : {_V16}",
        f"%f{tag}b = arith.addi %e{tag}_1, %e{tag}_3 : {_V16}",
        f"%h{tag} = arith.addi {hi}, %f{tag}b : {_V16}",
    ]


def _gemv_loop(kb: int, wt: str, xs: _XRows, ot: str, offset: bool) -> str:
    """One quantized row of x (row 0 of `xs`) against ROWS weight rows per step, one chunk of
    each. The ROWS rows come from ROWS streams, a quarter of the workgroup's rows each
    (rows r0 + i q + j, q = its rows / ROWS), so each stream reads its quarter front to
    back. The codes are decoded with one shift (`_codes(scaled=True)`) into two i16 sums
    per row, planes 0 + 2 and 4 x (planes 1 + 3), each over up to GEMV_I16_CHUNKS chunks
    before one vpmaddwd (by 4 and by 1) moves them, times 4, to the row's i32
    accumulator. (Two chunks a step spilled the 8 sums to the stack.)"""
    x = _x_planes(0, kb, xs)
    rows = ["%rj"] + [f"%rq{i}" for i in range(1, ROWS)]     # stream i's row this step
    body, lo, hi = [], {}, {}
    for i in range(ROWS):
        body += _codes(i, wt, offset, scaled=True, base=rows[i])
        body += _dot_chunk_scaled(str(i), f"q{i}", "x0", f"%pl{i}", f"%ph{i}")
        lo[i], hi[i] = f"%l{i}", f"%h{i}"
    s_iter = ", ".join(f"%pl{i} = %z16, %ph{i} = %z16" for i in range(ROWS))
    a_iter = ", ".join(f"%a{i} = %z32" for i in range(ROWS))
    t16, t32 = ", ".join([_V16] * 2 * ROWS), ", ".join([_V32] * ROWS)
    flush = []
    for i in range(ROWS):
        flush += [f"%wl{i} = {_MADW}(%part#{2 * i}, %fours16) : ({_V16}, {_V16}) -> {_V32}",
                  f"%wh{i} = {_MADW}(%part#{2 * i + 1}, %ones16) : ({_V16}, {_V16}) -> {_V32}",
                  f"%ws{i} = arith.addi %wl{i}, %wh{i} : {_V32}",
                  f"%na{i} = arith.addi %a{i}, %ws{i} : {_V32}"]
    nl = "\n"
    offsets = [f"%qoff{i} = arith.muli %q, %c{i} : index" for i in range(1, ROWS)]
    streams = [f"%rq{i} = arith.addi %rj, %qoff{i} : index" for i in range(1, ROWS)]
    return f"""
        %nq = arith.subi %r1, %r0 : index
        %q = arith.divui %nq, %cr : index
        {nl.join(offsets)}
        %rqend = arith.addi %r0, %q : index
        scf.for %rj = %r0 to %rqend step %c1 {{
          {nl.join(streams)}
          %acc:{ROWS} = scf.for %c16 = %c0 to %ckb step %cvblk iter_args({a_iter}) -> ({t32}) {{
            %cend0 = arith.addi %c16, %cvblk : index
            %cend = arith.minui %cend0, %ckb : index
            %part:{2 * ROWS} = scf.for %c = %c16 to %cend step %cc iter_args({s_iter}) -> ({t16}) {{
              {nl.join(x + body)}
              scf.yield {", ".join(f"{lo[i]}, {hi[i]}" for i in range(ROWS))} : {t16}
            }}
            {nl.join(flush)}
            scf.yield {", ".join(f"%na{i}" for i in range(ROWS))} : {t32}
          }}
          {nl.join(_stores([(i, 0) for i in range(ROWS)], ot, "acc", quarter=True, rows=rows))}
        }}"""


def _gemm_loop(kb: int, wt: str, xs: _XRows, ot: str, offset: bool) -> str:
    """MB quantized rows of x against GEMM_ROWS weight rows per step: each weight chunk
    is decoded once for MB rows of x. The i16 pair sums of a (row, x row) pair run over
    up to I16_CHUNKS chunks (|sum| <= 4 planes * 2 * 2 * 127 a chunk, so 16 chunks stay
    below 32767) before one vpmaddwd moves them to the i32 accumulator."""
    pairs = [(i, b) for i in range(GEMM_ROWS) for b in range(MB)]
    body = []
    for i in range(GEMM_ROWS):
        body += _codes(i, wt, offset)
    for b in range(MB):
        body += _x_planes(b, kb, xs)
    for i, b in pairs:
        body += _dot_chunk(f"{i}_{b}", f"q{i}", f"x{b}", f"%s{i}_{b}")
    s_iter = ", ".join(f"%s{i}_{b} = %z16" for i, b in pairs)
    a_iter = ", ".join(f"%a{i}_{b} = %z32" for i, b in pairs)
    t16, t32 = ", ".join([_V16] * len(pairs)), ", ".join([_V32] * len(pairs))
    flush = []
    for n, (i, b) in enumerate(pairs):
        flush += [f"%h{i}_{b} = {_MADW}(%part#{n}, %ones16) : ({_V16}, {_V16}) -> {_V32}",
                  f"%na{i}_{b} = arith.addi %a{i}_{b}, %h{i}_{b} : {_V32}"]
    nl = "\n"
    return f"""
        scf.for %r = %r0 to %r1 step %cg {{
          %acc:{len(pairs)} = scf.for %c16 = %c0 to %ckb step %cblk iter_args({a_iter}) -> ({t32}) {{
            %cend0 = arith.addi %c16, %cblk : index
            %cend = arith.minui %cend0, %ckb : index
            %part:{len(pairs)} = scf.for %c = %c16 to %cend step %cc iter_args({s_iter}) -> ({t16}) {{
              {nl.join(body)}
              scf.yield {", ".join(f"%n{i}_{b}" for i, b in pairs)} : {t16}
            }}
            {nl.join(flush)}
            scf.yield {", ".join(f"%na{i}_{b}" for i, b in pairs)} : {t32}
          }}
          {nl.join(_stores(pairs, ot, "acc"))}
        }}"""


def executable_text(name: str, n: int, kb: int, offset: bool = False,
                    prequantized: bool = False) -> str:
    """The `stream.executable @name` whose export `@name` computes, for x [M, 4 KB] f32
    (K zero-padded to 4 KB), w [N, KB] i8 packed (the offset codes w + 1 when `offset`,
    else the signed codes) and `wscale` (the ternary scale / 127),
    out [M, N] f32 = dequant(act_quant(x) @ T^T), T the ternary matrix of w: MB rows of x
    at a time through the GEMM loop, the remaining rows one by one through the GEMV loop.
    `prequantized`: x comes quantized by `ternary_avx2_quant`'s dispatch (its q and stats
    instead of x); else each workgroup quantizes the rows of x it needs itself, which
    costs every workgroup a read of all of x (nothing for a decode's row; at 128 rows,
    0.45x-0.53x NumPy's median against 0.34x-0.35x prequantized, 2026-11-24)."""
    kp = 4 * kb
    bt, wt, ot = f"memref<{MB}x{kp}xi8>", f"memref<{n}x{kb}xi8>", f"memref<?x{n}xf32>"
    qt = f"memref<?x{kp}xi8>"
    v8 = _V8
    xrows = "\n".join(f"          %xr{b} = affine.apply affine_map<(d0) -> (d0 + {b})>(%mrow)"
                       for b in range(MB))
    if prequantized:
        inputs = f"""
      %xq = stream.binding.subspan %bq[%c0] : !stream.binding -> {qt}{{%m}}
      %xs = stream.binding.subspan %bs[%c0] : !stream.binding -> memref<?x2xf32>{{%m}}"""
        block_x = "".join(row_stats(b, f"%xr{b}") for b in range(MB))
        row_x = row_stats(0, "%mrow")
        gemm_x = _XRows("%xq", qt, tuple(f"%xr{b}" for b in range(MB)))
        gemv_x = _XRows("%xq", qt, ("%mrow",))
        params = "%bq: !stream.binding, %bs: !stream.binding, "
    else:
        inputs = f"""
      %x = stream.binding.subspan %bx[%c0] : !stream.binding -> memref<?x{kp}xf32>{{%m}}
      %buf = memref.alloca() : {bt}"""
        fm = "\n          %fm{b} = arith.mulf %amc{b}, %wscale : f32"
        block_x = "".join(quantize_row(kp, b, f"%xr{b}", "%buf", f"%c{b}", bt)
                          + fm.format(b=b) for b in range(MB))
        row_x = quantize_row(kp, 0, "%mrow", "%buf", "%c0", bt) + fm.format(b=0)
        gemm_x = _XRows("%buf", bt, tuple(f"%c{b}" for b in range(MB)))
        gemv_x = _XRows("%buf", bt, ("%c0",))
        params = "%bx: !stream.binding, "
    body = f"""{common(kp, MB)}
      %cr = arith.constant {ROWS} : index
      %cg = arith.constant {GEMM_ROWS} : index
      %cmb = arith.constant {MB} : index
      %cc = arith.constant {CHUNK} : index
      %cblk = arith.constant {I16_CHUNKS * CHUNK} : index
      %cvblk = arith.constant {GEMV_I16_CHUNKS * CHUNK} : index
      %ckb = arith.constant {kb} : index
      %cn = arith.constant {n} : index{inputs}
      %w = stream.binding.subspan %bw[%c0] : !stream.binding -> {wt}
      %o = stream.binding.subspan %bo[%c0] : !stream.binding -> {ot}{{%m}}
      %wg = stream.dispatch.workgroup.id[0] : index
      %ng = stream.dispatch.workgroup.count[0] : index
      %rpg = arith.ceildivui %cn, %ng : index
      %rpr = arith.ceildivui %rpg, %cr : index
      %rpw = arith.muli %rpr, %cr : index
      %r0u = arith.muli %wg, %rpw : index
      %r0 = arith.minui %r0u, %cn : index
      %r1u = arith.addi %r0, %rpw : index
      %r1 = arith.minui %r1u, %cn : index
      %three = arith.constant dense<3> : {v8}
      %m55 = arith.constant dense<85> : {v8}
      %s1 = arith.constant dense<1> : {v8}
      %s2 = arith.constant dense<2> : {v8}
      %s4 = arith.constant dense<4> : {v8}
      %s6 = arith.constant dense<6> : {v8}
      %ones16 = arith.constant dense<1> : {_V16}
      %fours16 = arith.constant dense<4> : {_V16}
      %twelve = arith.constant dense<12> : {v8}
      %c2i32 = arith.constant 2 : i32
      %z16 = arith.constant dense<0> : {_V16}
      %z32 = arith.constant dense<0> : {_V32}
      %mblocks = arith.divui %m, %cmb : index
      %mfull = arith.muli %mblocks, %cmb : index
      scf.for %mrow = %c0 to %mfull step %cmb {{
{xrows}{block_x}{_gemm_loop(kb, wt, gemm_x, ot, offset)}
      }}
      scf.for %mrow = %mfull to %m step %c1 {{{row_x}{_gemv_loop(kb, wt, gemv_x, ot, offset)}
      }}"""
    return wrap_executable(name, (DECODE_WORKGROUPS, WORKGROUPS, MB),
                           params + "%bw: !stream.binding, %bo: !stream.binding, "
                           "%wscale: f32, %m: index", body)


def emit(kern) -> ir.Value:
    """y [M, N] f32 for the `_Kernel` `kern` (activation quantization always on). For a
    static M below MB (a decode) the matmul's dispatch quantizes x itself; for any other
    M (a symbolic one too) a dispatch of its own quantizes x first, once for every
    matmul of x. (A symbolic decode measured alike, within the noise and in both load
    orders, with x quantized in the matmul's dispatch, by this dispatch, or by this
    dispatch for whole blocks of MB rows only: 0.17x-0.22x NumPy's median for one call
    of one 4096x4096 layer, 0.09x-0.14x a layer for 16 cold layers a call, 2026-11-24.)"""
    offset = kern.codes == "offset"
    prequantized = kern.m is None or kern.m >= MB
    name = (f"tern_avx2_gemv_{kern.n}x{kern.kb}{'_offset' if offset else ''}"
            f"{'_q' if prequantized else ''}")
    ensure_executable(name, lambda: executable_text(name, kern.n, kern.kb, offset,
                                                    prequantized))
    m = kern.m_values[0] if kern.m_values else arith.constant(kern.index, kern.m)
    dims = list(kern.m_values)
    x = [kern.pad_k(kern.x)]
    if prequantized:
        x = quantized(kern, x[0], m, dims)
    # the scale is an operand, not a constant of the executable: every layer of a shape
    # shares one executable
    wscale = arith.constant(kern.f32, float(np.float32(kern.scale / ACT_MAX)))
    return dispatch(name, name, [m], [*x, kern.weights(), wscale, m],
                    dims * len(x), kern.ttype([kern.n], kern.f32), dims)
