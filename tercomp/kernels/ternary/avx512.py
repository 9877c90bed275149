"""The "avx512" ternary matmul kernel: the avx2 kernel (`avx2`: the same packed layout,
offset codes, quantize dispatch, GEMV and GEMM loops and workgroups) on 512-bit vectors
with AVX-512 VNNI's `vpdpbusd`, for hosts that have it.

Per 64 packed bytes of a row (256 weights) and a row of x, the loop is

    u  = the bytes (offset codes w + 1), or the signed codes remapped as in avx2
    a += vpdpbusd(u & 3, x_0) + vpdpbusd((u >> 4) & 3, x_2)
    b += vpdpbusd(u & 12, x_1) + vpdpbusd((u >> 4) & 12, x_3)

(u8 x s8 products, 4 to an i32 lane, added into the lane), and y = ((4 sum(a) +
sum(b)) / 4 - sum(x)) * scale * max|x| / 127 at the end. Against the avx2 kernel:
twice the bytes a vector, and `vpdpbusd` replaces vpmaddubsw + vpaddw + the periodic
vpmaddwd (no i16 stage, so no inner block loop bounding the i16 sums); the decode is
one shift and four ands a chunk (planes 1 and 3 read 4 times their codes and sum into
their own accumulator), done on i32 lanes (no carry or borrow crosses a 2-bit field).

The GEMM loop (M >= MB, always on the quantize dispatch's codes) differs in its order:
tiles of TILE_ROWS weight rows outside, blocks of MB rows of x inside, so each tile is
read from memory once and meets every block of x from L1/L2; the avx2 kernel's order
(each block of x against all the workgroup's rows) read the weights once per block,
and with its prefetchnta they came from L3 each time. Conclusions on a 2-core Xeon with
AVX-512 VNNI (bench/RESULTS.md): against avx2 in the same runs, 2-3x faster at 8 and 16
rows of x and 1.6-1.9x at 128; decode (M = 1, memory-bound) measured alike; vpdpbusd
on zmm issues as often as on ymm here (twice the products an instruction), and a ymm
GEMV loop measured alike with the zmm one, so the kernel uses zmm throughout.

Needs: llvm-cpu on a host with AVX-512 VNNI (avx512bw comes with it), K/4 a multiple
of 64 and N a multiple of 4 (`fits`, the kernel table row's condition: the table gives
other shapes another kernel, the avx2 one where it fits).
"""
from __future__ import annotations

from iree.compiler import ir

from ..template import render
from . import avx2
from .avx2_quant import quant_literals

#: Packed bytes per row that one vector covers (64 bytes: 256 weights, one cache line).
CHUNK = 64
#: Output rows of the GEMV loop that share one pass over x, one from each stream.
ROWS = avx2.ROWS
#: Rows of x multiplied together in the GEMM loop (M >= MB).
MB = avx2.MB
#: Weight rows decoded a GEMM step: 2 x MB x 2 accumulators, 8 code vectors, x read as
#: vpdpbusd's memory operand (28 of the 32 zmm registers, no spills). Two rows measured
#: 5-15% faster than one at 8, 16 and 128 rows of x; 8 rows of x with one weight row
#: measured between the two (bench/RESULTS.md).
GEMM_ROWS = 2
#: Weight rows a GEMM tile: every block of MB rows of x meets the tile before the next
#: one is read, so the weights come from memory once a call (32 KB of a 4096-wide
#: weight: L1 and L2) and a block of x (16 KB) stays in L1 across the tile. Blocks of x
#: outside the tile loop (the avx2 kernel's order) read the weights once per block:
#: 2.3x slower at 8 rows here, where prefetchnta leaves them out of L2. 32 measured
#: alike with 16 and 8 at 8 and 16 rows and a little faster at 128.
TILE_ROWS = 32
#: Prefetch distances and workgroups: the avx2 kernel's (avx2.py says why).
PREFETCH_ROWS = avx2.PREFETCH_ROWS
STREAM_AHEAD = avx2.STREAM_AHEAD
WORKGROUPS = avx2.WORKGROUPS
DECODE_WORKGROUPS = avx2.DECODE_WORKGROUPS
#: The largest 4 KB: a decode's workgroup quantizes its row of x into a buffer of 4 KB
#: bytes on its stack, within IREE's 32 KiB default (the GEMM loop reads the quantize
#: dispatch's codes), so it takes Llama-3-8B's 14336-wide down projection too.
MAX_KP = 16384


def fits(k_bytes: int, n: int) -> bool:
    """Whether the kernel takes a [N, KB] packed matrix."""
    return k_bytes % CHUNK == 0 and n % ROWS == 0 and 4 * k_bytes <= MAX_KP


def executable_text(name: str, n: int, kb: int, offset: bool = False,
                    prequantized: bool = False) -> str:
    """The `stream.executable @name` (templates/ternary_avx512.mlir): avx2.executable_text's
    contract (x [M, 4 KB] f32 or its quantized codes and stats, w [N, KB] i8 in offset or
    signed codes, `wscale`; out [M, N] f32) with 64-byte chunks and vpdpbusd."""
    return render("ternary_avx512", name=name, n=n, kb=kb, offset=offset,
                  prequantized=prequantized, rows=ROWS, mb=MB, gemm_rows=GEMM_ROWS,
                  tile_rows=TILE_ROWS,
                  chunk=CHUNK, prefetch_rows=PREFETCH_ROWS, stream_ahead=STREAM_AHEAD,
                  workgroups=WORKGROUPS, decode_workgroups=DECODE_WORKGROUPS,
                  **quant_literals())


def emit(kern) -> ir.Value:
    """y [M, N] f32 for the `TernaryBuilder` `kern` (activation quantization always on),
    as avx2.emit: a static M below MB quantizes x in the matmul's dispatch, any other M
    reads the quantize dispatch's codes (the one avx2 uses, shared with it)."""
    return avx2.emit_with(kern, "tern_avx512_gemv", executable_text)
