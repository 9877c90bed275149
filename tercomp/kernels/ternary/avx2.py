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

Needs: llvm-cpu with AVX2, K/4 a multiple of 32 and N a multiple of 4 (`fits`, the
kernel table row's condition: the table gives other shapes another kernel).
"""
from __future__ import annotations

import numpy as np
from iree.compiler import ir
from iree.compiler.dialects import arith

from ...ternary_pack import ACT_MAX
from ...codegen.executables import dispatch, ensure_executable
from ..template import render
from . import im2col_quant
from .avx2_quant import quant_literals, quantized, unpadded

#: Output rows that share one pass over x.
ROWS = 4
#: Packed bytes per row that one vector covers (32 bytes: 128 weights).
CHUNK = 32
#: How many rows ahead the GEMM loop prefetches each row's bytes (two row groups):
#: without a prefetch one core streamed far below the memory's rate (bench/RESULTS.md).
PREFETCH_ROWS = 8
#: The GEMV loop reads its ROWS rows from ROWS streams, one per quarter of the
#: workgroup's rows, each prefetched into L1 this many rows ahead. Far-apart streams keep
#: more DRAM reads in flight than adjacent rows do, which made cold decode about 1.5x
#: faster (bench/RESULTS.md).
STREAM_AHEAD = 2


#: Rows of x quantized and multiplied together in the GEMM loop (M >= MB).
MB = 4
#: Weight rows decoded per GEMM step (GEMM_ROWS x MB i16 and i32 accumulators). One row
#: keeps its 4 code planes and the MB i16 sums in registers; two rows (8 + 8 vectors of
#: AVX2's 16) spilled and were slower (bench/RESULTS.md).
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
#: rows (M >= MB), to even out a core that the host takes away (8 beat 4 at 128 rows;
#: 16 measured alike with 8). Decode (M = 1) measured the same with either, and every
#: extra workgroup quantizes x once more, so M < MB gets 4 (bench/RESULTS.md).
WORKGROUPS = 8
DECODE_WORKGROUPS = 4


def fits(k_bytes: int, n: int) -> bool:
    """Whether the kernel takes a [N, KB] packed matrix."""
    return k_bytes % CHUNK == 0 and n % ROWS == 0 and 4 * k_bytes <= MAX_KP


def executable_text(name: str, n: int, kb: int, offset: bool = False,
                    prequantized: bool = False) -> str:
    """The `stream.executable @name` (templates/ternary_avx2.mlir) whose export `@name`
    computes, for x [M, 4 KB] f32 (K zero-padded to 4 KB), w [N, KB] i8 packed (the
    offset codes w + 1 when `offset`, else the signed codes) and `wscale` (the ternary
    scale / 127), out [M, N] f32 = dequant(act_quant(x) @ T^T), T the ternary matrix of
    w: MB rows of x at a time through the GEMM loop, the remaining rows one by one
    through the GEMV loop. `prequantized`: x comes quantized by `avx2_quant`'s
    dispatch (its q and stats instead of x); else each workgroup quantizes the rows of x
    it needs itself, which costs every workgroup a read of all of x (nothing for a
    decode's row; slower at 128 rows: bench/RESULTS.md)."""
    return render("ternary_avx2", name=name, n=n, kb=kb, offset=offset,
                  prequantized=prequantized, rows=ROWS, mb=MB, gemm_rows=GEMM_ROWS,
                  chunk=CHUNK, i16_chunks=I16_CHUNKS, gemv_i16_chunks=GEMV_I16_CHUNKS,
                  prefetch_rows=PREFETCH_ROWS, stream_ahead=STREAM_AHEAD,
                  workgroups=WORKGROUPS, decode_workgroups=DECODE_WORKGROUPS,
                  **quant_literals())


def emit(kern) -> ir.Value:
    """y [M, N] f32 for the `TernaryBuilder` `kern` (activation quantization always on). For a
    static M below MB (a decode) the matmul's dispatch quantizes x itself; for any other
    M (a symbolic one too) a dispatch of its own quantizes x first, once for every
    matmul of x. (A symbolic decode measured alike whichever dispatch quantizes x:
    bench/RESULTS.md.)"""
    return emit_with(kern, "tern_avx2_gemv", executable_text)


def emit_with(kern, prefix: str, text) -> ir.Value:
    """The dispatch of a kernel with the avx2 kernel's operands and quantization rule:
    its executable `prefix`_NxKB[_offset][_q] made by `text(name, n, kb, offset,
    prequantized)` (the avx512 kernel shares all of it but its text)."""
    offset = kern.codes == "offset"
    prequantized = kern.m is None or kern.m >= MB
    name = f"{prefix}_{kern.n}x{kern.kb}{'_offset' if offset else ''}{'_q' if prequantized else ''}"
    ensure_executable(name, lambda: text(name, kern.n, kern.kb, offset, prequantized))
    m = kern.m_values[0] if kern.m_values else arith.constant(kern.index, kern.m)
    dims = list(kern.m_values)
    if prequantized:
        x = im2col_quant.quantized(kern, m, dims) or quantized(
            kern, kern.x if unpadded(kern) else kern.pad_k(kern.x), m, dims)
    else:
        x = [kern.pad_k(kern.x)]
    # the scale is an operand, not a constant of the executable: every layer of a shape
    # shares one executable
    wscale = arith.constant(kern.f32, float(np.float32(kern.scale / ACT_MAX)))
    return dispatch(name, name, [m], [*x, kern.weights(), wscale, m],
                    dims * len(x), kern.ttype([kern.n], kern.f32), dims)
