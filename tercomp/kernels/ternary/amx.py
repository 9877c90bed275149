"""The avx512 ternary kernel with AMX tiles for the rows of x in whole blocks of 16 (a
prefill's), on hosts with AMX-INT8 (Sapphire Rapids and later Xeons):

    q, xv = x quantized, and its B tiles (templates/ternary_amx_quant.mlir, one dispatch)
    for each 16 weight rows of the workgroup, K in chunks of 256 packed columns:
        A tiles = the chunk's 2-bit codes spread to bytes (vpermb + vpmultishiftqb)
        C[16 blocks of x] += tdpbusd(A, B)     a group of 4 blocks at a time
    y = (C^T - sum(x)) * scale(x) * wscale     the avx512 GEMM loop's dequantization

The rest of each call (the rows past the last whole block of 16, a decode's rows) goes
through the avx512 kernel's loops unchanged: same executable, same constant, same
quantized x, so a row's result does not depend on which loop took it (both sum the
same integer products exactly).

The layout is chosen so that neither the weights nor the products need a transpose in
the inner loop. `tdpbusd` multiplies an A tile of unsigned bytes (16 rows x 64) with a
B tile of signed bytes in VNNI order (16 rows of 16 x 4): the A tile is 16 weight
rows, row i byte 4 kk + j holding plane j of packed byte (row i, column c + kk), which
is a packed row's 16 bytes each spread into 4, with no data moved between rows; the B
tile is x's codes for those same K columns (c + kk + j KB: plane j of column c + kk)
laid out by the xv dispatch once per call. C then holds [weight row, row of x] and is
turned round once per 16 x 16 block at the end (64 shuffles for 16 K / 64 tdpbusd).
Between chunks the C tiles go through y's own rows (the workgroup owns those columns),
so no stack buffer grows with M.

Needs: llvm-cpu on a host with AMX-INT8 and AMX-TILE, and the process's permission to
use the tile data (Linux: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), which
`enable` asks for; the kernel table offers the row only where it was granted), the
avx512 kernel's shapes with N a multiple of 16, and offset codes.
"""
from __future__ import annotations

import numpy as np
from iree.compiler import ir
from iree.compiler.dialects import arith

from ...ternary_pack import ACT_MAX
from ...codegen.executables import dispatch, ensure_executable
from ..host import AMX_FEATURES, enable_amx, host_cpu_features
from ..template import render
from . import avx512, im2col_quant
from .avx2_quant import quant_literals, unpadded

#: Packed columns a chunk of K: 8 steps of NA A tiles (16 KB of spread codes on the
#: stack), each meeting every block of x of the superblock before the next chunk.
#: (Measured alike with 256 columns and NA 1 at 128 rows of x; bench/RESULTS.md.)
KC = 128
#: Tiles of 16 weight rows a step (A tiles).
NA = 2
#: Blocks of 16 rows of x multiplied together (B tiles): NA x GROUP = 4 C tiles, NA A
#: and GROUP B tiles, the 8 tile registers; each tile load then serves two tdpbusd.
GROUP = 2
#: Blocks of x whose C tiles stay on the stack (16 KB) while the weights go by once.
SUPER = 8
#: The stack a workgroup needs (the chunk's spread codes and the superblock's C tiles,
#: 16 KB each, and the avx512 loops' buffers): the row's IREE flag.
STACK_LIMIT = 65536
#: Rows of x a block (a tile's rows).
BLOCK = 16
#: The fewest rows of x the AMX loop takes as a block, padded with zero rows (below it
#: they go through avx512's loops). 16: no padded block. At 8, a batched decode's 8
#: sequences took the tiles: the kernel alone measured 0.83-1.0x avx512's time at
#: 8x1536x4096 and 8x4096x1536, but the 700M batched step at 8 sequences went from
#: 2.56x to 2.28x one sequence's tokens/s (bench/RESULTS.md).
PAD = 16
#: Rows of x a workgroup of the quantize dispatch takes below PAD rows (a batched
#: decode's, which write no tiles); from PAD rows on, a block of 16 a workgroup. One
#: workgroup of 16 left a batched step's 8 rows to one thread (bench/RESULTS.md,
#: 2026-11-28 "Row kernels at a batched step's rows").
SMALL_ROWS = 4
#: The smallest static M that takes the kernel (below it: avx512's dispatch).
MIN_M = PAD
#: The fewest weights (N x K) a matrix needs for "auto" to give it the kernel. Each AMX
#: executable adds 0.5-1 s of compile time, about twice the avx512 one's; below a
#: million weights the kernel saved 0.02-0.04 ms a 128-row matmul (128x256x512: 0.128
#: against 0.165 ms; 128x512x256: 0.111 against 0.135), from 1024 x 1024 up 0.15 ms and
#: more (128x1024x1024: 0.29 against 0.44; 128x1536x1536: 0.98 against 1.52;
#: bench/RESULTS.md). A model that small gained less at a prefill than its compile lost.
MIN_WEIGHTS = 1 << 20
#: The host features the tiles need.
FEATURES = AMX_FEATURES


def enable() -> bool:
    """Whether this process may run the kernel (host.enable_amx: asks Linux once)."""
    return enable_amx()


def fits(k_bytes: int, n: int) -> bool:
    """Whether the kernel takes a [N, KB] packed matrix (avx512's shapes, N by 16)."""
    return avx512.fits(k_bytes, n) and n % (NA * BLOCK) == 0


def executable_text(name: str, n: int, kb: int, offset: bool = True,
                    prequantized: bool = True, gfni: bool | None = None) -> str:
    """avx512.executable_text's kernel with the AMX loop for the whole blocks of 16 rows
    of x ahead of its GEMM loop (prequantized only: a decode's dispatch is avx512's)."""
    amx = offset and prequantized
    if gfni is None:
        gfni = avx512.GFNI in host_cpu_features()
    return render("ternary_avx512", name=name, n=n, kb=kb, offset=offset,
                  prequantized=prequantized, rows=avx512.ROWS, blocks=avx512.BLOCKS,
                  gfni=gfni, tile_rows=avx512.TILE_ROWS, kchunk=avx512.k_chunk(kb),
                  chunk=avx512.CHUNK, prefetch_rows=avx512.PREFETCH_ROWS,
                  stream_ahead=avx512.STREAM_AHEAD, workgroups=avx512.WORKGROUPS,
                  decode_workgroups=avx512.DECODE_WORKGROUPS, amx=amx, amx_kc=KC,
                  amx_rows=NA, amx_group=GROUP, amx_super=SUPER, amx_pad=PAD, **quant_literals())


def quantize_text(name: str, kb: int, kx: int | None = None) -> str:
    """The `stream.executable @name` (templates/ternary_amx_quant.mlir): avx2_quant's
    quantize dispatch, 16 rows a workgroup (SMALL_ROWS below PAD rows), writing the B
    tiles of each whole block of 16 rows too: x -> q [M, 4 KB] i8, stats [M, 2] f32, xv [M // 16, 64 KB] i8."""
    return render("ternary_amx_quant", name=name, kb=kb, kx=kx, pad=PAD,
                  small_rows=SMALL_ROWS, **quant_literals())


def _shared(x: ir.Value, name: str):
    """The dispatch of executable `name` already emitted on x in this block, if any (the
    matmuls of one x, such as q, k and v, share its quantization)."""
    callee = ir.ArrayAttr.get([ir.SymbolRefAttr.get([name, name])])
    block = ir.InsertionPoint.current.block
    for use in x.uses:
        op = getattr(use.owner, "operation", use.owner)
        if (op.name == "flow.dispatch" and op.attributes["entry_points"] == callee
                and op.block == block):
            return op
    return None


def _xv_type(kern) -> ir.RankedTensorType:
    blocks = ir.ShapedType.get_dynamic_size() if kern.m is None else (kern.m + BLOCK - PAD) // BLOCK
    return ir.RankedTensorType.get([blocks, 64 * kern.kb], kern.i8)


def _quantized(kern, m: ir.Value, dims) -> tuple[list[ir.Value], list[ir.Value]]:
    """([q, stats, xv] of x, xv's dynamic sizes) from the fused quantize dispatch
    (quantize_text), one per x."""
    xv_dims = ([arith.divui(arith.addi(m, arith.constant(kern.index, BLOCK - PAD)),
                            arith.constant(kern.index, BLOCK))] if dims else [])
    x = kern.x if unpadded(kern) else kern.pad_k(kern.x)
    kx = int(ir.RankedTensorType(x.type).get_dim_size(1))
    kx = None if kx == 4 * kern.kb else kx
    name = f"tern_amx_quant_{kern.kb}" + (f"_x{kx}" if kx is not None else "")
    found = _shared(x, name)
    if found is not None:
        return list(found.results), xv_dims
    ensure_executable(name, lambda: quantize_text(name, kern.kb, kx))
    return dispatch(name, name, [m], [x, m], dims,
                    [kern.ttype([4 * kern.kb], kern.i8), kern.ttype([2], kern.f32),
                     _xv_type(kern)], dims + dims + xv_dims), xv_dims


def emit(kern) -> ir.Value:
    """y [M, N] f32 for the `TernaryBuilder` `kern`: avx512.emit's for a static M below
    MIN_M (a decode's rows) and for a convolution's patch rows (quantized from the padded
    input by im2col_quant's dispatch, as measured for issue #34; the tiles would need a
    second int8 copy of the patches), else one dispatch of the kernel after the fused
    quantize dispatch. A symbolic M needs no branch: below 16 rows the AMX loop has no block to
    take and the quantize writes no tiles, so a decode costs what avx512's does."""
    if (kern.codes != "offset" or (kern.m is not None and kern.m < MIN_M)
            or im2col_quant.patches_source(kern.x) is not None):
        return avx512.emit(kern)
    enable()        # the compiling process may run the module (tests, tc.compile's check)
    name = f"tern_amx_gemm_{kern.n}x{kern.kb}_offset_q"
    ensure_executable(name, lambda: executable_text(name, kern.n, kern.kb))
    m = kern.m_values[0] if kern.m_values else arith.constant(kern.index, kern.m)
    dims = list(kern.m_values)
    (q, stats, xv), xv_dims = _quantized(kern, m, dims)
    wscale = arith.constant(kern.f32, float(np.float32(kern.scale / ACT_MAX)))
    return dispatch(name, name, [m], [q, stats, xv, kern.weights(), wscale, m],
                    dims * 2 + xv_dims, kern.ttype([kern.n], kern.f32), dims)
