"""The "avx512" ternary matmul kernel: the avx2 kernel (`avx2`: the same packed layout,
offset codes, quantize dispatch, GEMV and GEMM loops and workgroups) on 512-bit vectors
with AVX-512 VNNI's `vpdpbusd`, for hosts that have it.

Per 64 packed bytes of a row (256 weights) and a row of x, the GEMV loop (a decode's
row of x) is

    u  = the bytes (offset codes w + 1), or the signed codes remapped as in avx2
    a += vpdpbusd(u & 3, x_0) + vpdpbusd((u >> 4) & 3, x_2)
    b += vpdpbusd(u & 12, x_1) + vpdpbusd((u >> 4) & 12, x_3)

(u8 x s8 products, 4 to an i32 lane, added into the lane), and y = ((4 sum(a) +
sum(b)) / 4 - sum(x)) * scale * max|x| / 127 at the end. Against the avx2 kernel:
twice the bytes a vector, and `vpdpbusd` replaces vpmaddubsw + vpaddw + the periodic
vpmaddwd (no i16 stage, so no inner block loop bounding the i16 sums); the decode is
one shift and four ands a chunk (planes 1 and 3 read 4 times their codes and sum into
their own accumulator), done on i32 lanes (no carry or borrow crosses a 2-bit field).

The GEMM loop (blocks of 8, 4 and 2 rows of x: `BLOCKS`, always on the quantize
dispatch's codes) takes tiles of TILE_ROWS weight rows outside and the blocks of x
inside, so each tile is read from memory once and meets every block of x from L1/L2
(the avx2 kernel's order, each block of x against all the workgroup's rows, read the
weights once per block, from L3 each time with its prefetchnta). Each plane is
decoded to its own codes (one gf2p8affineqb a plane on a host with GFNI: a bit matrix
that moves bits 2j, 2j + 1 of every byte to bits 0, 1; else a shift and an and), so
the 4 products of a (weight row, row of x) pair go into one accumulator, and a step's
16 sums (2 weight rows x 8 rows of x) are reduced together: a transposing tree of
shuffles and adds leaves sum p in lane p (45 instructions, against about 12 a sum
reduced alone, which at K = 1536, 6 chunks of 64 bytes, cost as many instructions as
the products), dequantized on 16 lanes at once and stored 2 floats a row of x.

Conclusions on a 2-core Xeon (Emerald Rapids class, two 512-bit vpdpbusd a cycle per
core) with AVX-512 VNNI, 2026-11-27, a machine at load 7-9 (bench/RESULTS.md): this GEMM
loop against the one before it (blocks of 4 rows x 2 weight rows, two accumulators a
pair, each sum reduced alone) in the same runs, min / median ms of a call: 8x1536x1536
0.108 / 0.133 against 0.126 / 0.173, 8x1536x4096 0.236 / 0.402 against 0.270 / 0.519,
8x4096x1536 0.225 / 0.326 against 0.290 / 0.392, 128x1536x4096 2.31 / 15.3 against
3.22 / 15.6, 512x1536x4096 39.9 / 63.2 against 54.0 / 77.8; M = 1 (the GEMV loop, not
changed) alike; the 700M batched generator's step at 8 sequences 1.2x faster and a
128-token prefill 1.23x. What did not help: the reduction tree alone (blocks of 4)
took 0.197 ms at 8x1536x4096 where this loop took 0.188; 8 rows x 1 weight row with
the scaled decode (0.220), the shift decode with 8 x 2 (0.194), 16 rows x 1 weight row
at 128 rows (slower), prefetching 4, 12, 16 or 32 rows ahead, tiles of 8, 16 or 64
rows, 2, 4 or 16 workgroups: alike or slower. The tree on the GEMV loop's 4 sums
measured alike with its own reductions (left so: decode is bound by memory). The
products are now near the port bound at K = 1536 with warm weights: 64 vpdpbusd + 8
gf2p8affineqb a step on the two vector ports, 36 cycles for 64 products.
Against avx2 (before these changes): 2-3x faster at 8 and 16 rows of x and 1.6-1.9x
at 128; vpdpbusd on zmm issues as often as on ymm here (twice the products an
instruction), and a ymm GEMV loop measured alike with the zmm one, so the kernel uses
zmm throughout.

K-blocking (`k_chunk`): a block of 8 rows of x is 32 KB of codes at K = 4096, and stays
in L1 (48 KB here) while it meets the tile's 32 weight rows; at Llama-3-8B's down
projection (K = 14336) it is 114 KB, and every step read its 32 x lines from L2 (the
down projection ran at ~0.6x the GOP/s of 128x4096x14336, the same MACs). Past
K_WHOLE_MAX packed bytes (K = 4096) the GEMM loop runs K in chunks of K_CHUNK packed
bytes (the last one shorter): each chunk of the block's x (8 x 4 x 512 = 16 KB) meets
every step of the tile (16 KB of weights) before the next chunk, each step's 16 sums
reduced after each chunk (reduce16) and added into a [16, 16] i32 stack buffer, then
dequantized after the last chunk (the reduction, ~5% of a 512-byte chunk's
instructions, keeps the buffer 1 KB). Interleaved against whole rows on this machine
at load 4-8, 2026-11-27 (bench/RESULTS.md), by the minima of three runs: 128x14336x4096
1.36-1.70x faster (31-38 ms against 49-53: now the rate of 128x4096x14336, the same
MACs, in the same run), 8x14336x4096 1.28-1.35x, 128x6912x2560 (2B4T) 1.08-1.47x
(four runs); chunks of 256, 384, 512 and 768 bytes alike, 1024 slower. At K = 4096 the
same chunking measured alike within the noise (128x4096x4096 min 0.71-1.12x, medians
0.99-1.01x), so up to K_WHOLE_MAX the loop takes whole rows (the same code as before).

Not faster at the 8B shapes (bench/RESULTS.md, 2026-11-28): decoding each K-chunk of a
tile once for all blocks of x into a stack buffer (the product loop without
gf2p8affineqb: 0.6-0.9x), 4 x 4 blocks, the K-chunks outermost so x stays in L2 (0.98x
at K = 14336), the weight prefetch into L2 only or none, 16 or 32 workgroups. By CPU time
the loop runs at ~75% of this host's vpdpbusd rate at 128x4096x14336.

Needs: llvm-cpu on a host with AVX-512 VNNI (avx512bw comes with it), K/4 a multiple
of 64 and N a multiple of 4 (`fits`, the kernel table row's condition: the table gives
other shapes another kernel, the avx2 one where it fits).
"""
from __future__ import annotations

from iree.compiler import ir

from ..host import host_cpu_features
from ..template import render
from . import avx2
from .avx2_quant import quant_literals

#: The host feature whose gf2p8affineqb decodes a plane in one instruction (Ice Lake
#: and later, Zen 4); without it the GEMM loop decodes a plane with a shift and an and.
GFNI = "gfni"
#: Packed bytes per row that one vector covers (64 bytes: 256 weights, one cache line).
CHUNK = 64
#: Output rows of the GEMV loop that share one pass over x, one from each stream.
ROWS = avx2.ROWS
#: The GEMM loop's blocks, largest first: (rows of x multiplied together, weight rows
#: decoded a step, accumulators a (weight row, row of x) pair). The rows of x go in
#: blocks of 8 while 8 are left, then of 4, then of 2, the last one (if any) through the
#: GEMV loop, so every batch from 2 rows up reads each weight chunk once per block.
#: 8 x 2 with one accumulator a pair: 16 accumulators, the 2 rows' bytes, a plane of
#: each decoded at a time, the x vector and the 4 bit matrices in registers (no spills
#: in the dumped assembly), 64 vpdpbusd to 8 gf2p8affineqb a step; each chunk decoded
#: once at M = 8, where blocks of 4 decoded it twice. The small blocks keep two
#: accumulators a pair (chains of two vpdpbusd: with 8 or fewer pairs a chain of four
#: would wait on vpdpbusd's latency). Blocks of 2 made 2, 6 and 7 rows of x 15-20%
#: faster than the GEMV loop for those rows (bench/RESULTS.md).
BLOCKS = ((8, 2, 1), (4, 2, 2), (2, 2, 2))
#: The smallest block: batches below it (a decode) take the GEMV loop only.
MB = BLOCKS[-1][0]
#: Weight rows a GEMM tile: every block of rows of x meets the tile before the next
#: one is read, so the weights come from memory once a call (32 KB of a 4096-wide
#: weight: L1 and L2) and a block of x (32 KB at 8 rows of 4096) stays in L1/L2 across
#: the tile. Blocks of x outside the tile loop (the avx2 kernel's order) read the
#: weights once per block: 2.3x slower at 8 rows here, where prefetchnta leaves them
#: out of L2. 32 measured alike with 16 and 8 at 8 and 16 rows and a little faster at
#: 128 (blocks of 4); with blocks of 8, 16 and 64 measured alike with 32 at 8 and 128.
TILE_ROWS = 32
#: The GEMM loop's K-chunk past K_WHOLE_MAX (packed bytes; the module docstring says
#: why): 8 rows of x's codes (16 KB) and the tile's 32 weight rows (16 KB) in L1.
K_CHUNK = 512
#: The largest packed K that the GEMM loop takes in whole rows (K = 4096: a block of 8
#: rows of x is 32 KB and stays in L1 across the tile).
K_WHOLE_MAX = 1024
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


def k_chunk(kb: int) -> int:
    """Packed bytes of the GEMM loop's K-chunk for a packed K of `kb` (kb itself: whole
    rows, no K-blocking)."""
    return kb if kb <= K_WHOLE_MAX else K_CHUNK


def executable_text(name: str, n: int, kb: int, offset: bool = False,
                    prequantized: bool = False, gfni: bool | None = None) -> str:
    """The `stream.executable @name` (templates/ternary_avx512.mlir): avx2.executable_text's
    contract (x [M, 4 KB] f32 or its quantized codes and stats, w [N, KB] i8 in offset or
    signed codes, `wscale`; out [M, N] f32) with 64-byte chunks and vpdpbusd. `gfni`:
    whether the GEMM loop decodes offset codes with gf2p8affineqb (default: whether the
    host has GFNI, as the kernel compiles for the host)."""
    if gfni is None:
        gfni = GFNI in host_cpu_features()
    return render("ternary_avx512", name=name, n=n, kb=kb, offset=offset,
                  prequantized=prequantized, rows=ROWS, blocks=BLOCKS,
                  gfni=gfni, tile_rows=TILE_ROWS, kchunk=k_chunk(kb),
                  chunk=CHUNK, prefetch_rows=PREFETCH_ROWS, stream_ahead=STREAM_AHEAD,
                  workgroups=WORKGROUPS, decode_workgroups=DECODE_WORKGROUPS,
                  amx=False, amx_kc=0, amx_rows=0, amx_group=0, amx_super=0, amx_pad=16, **quant_literals())


def emit(kern) -> ir.Value:
    """y [M, N] f32 for the `TernaryBuilder` `kern` (activation quantization always on),
    as avx2.emit: a static M below avx2's MB (4) quantizes x in the matmul's dispatch
    (the GEMV loop only), any other M
    reads the quantize dispatch's codes (the one avx2 uses, shared with it)."""
    return avx2.emit_with(kern, "tern_avx512_gemv", executable_text)
