"""The "avx512-tall" ternary matmul kernel: for M much larger than N (a convolution's
patch rows: M = batch x output positions, N = the output channels), the rows of x in
the vector lanes instead of K.

The avx512 kernel (`avx512`) puts 64 bytes of K in a vector and sums each output's 16
i32 lanes at the end: a horizontal reduction and a scalar store per output, which at a
conv's short K (576-4608) and small N costs about as much as the products. Measured on
bench/conv.py's shapes (bench/RESULTS.md): M = 8192, K = 1280, N = 128 ran at a quarter
of the products per second that 128 x 1536 x 4096 reaches. Here each lane is one row
of x, so nothing is reduced across lanes:

    q[b, cb]   64 bytes: lane l = the int8 codes of row 16 b + l at columns cb + j KB
               (j = 0..3, the four planes of packed weight byte cb), written by this
               kernel's quantize dispatch (templates/ternary_lanes_quant.mlir)
    wdec[r, cb] = the 4 offset codes (w + 1) of packed byte cb of weight row r, one a
               byte (decoded once a workgroup per ROWS weight rows, on its stack)
    acc[r][b] += vpdpbusd(broadcast(wdec[r, cb]), q[b, cb])

and y[16 b + l, r] = (acc - sum of row's codes) * max|x| / 127 * scale per lane,
transposed in registers and stored ROWS floats a row. Workgroups split M (the avx512
kernel splits N), so the weights of a small N stay in L1/L2 for every block of x.

The quantize dispatch reads a convolution's padded input directly where x is its
im2col (as `im2col_quant` does for the avx512 kernel), a plain x [M, K] otherwise; a
block's 16 rows are one vector load a column where they are 16 neighbouring output
positions at stride 1; runs of one output row each (OW a multiple of 16 at a stride, OW
= 4 or 8) are 1-4 loads merged by shuffles (`segments`: this host's gathers ran at
about a quarter of that rate), anything else a gather. A column's offset in the image
comes from a constant table in the executable (built on each workgroup's stack before,
it was about half the instructions of the 64-channel layers' dispatch). A 3x3 conv
whose K is four whole planes of kernel positions (64+ channels) is quantized from its
UNPADDED input instead (`unpadded`, templates/ternary_lanes_quant_unpadded.mlir: masked
loads at the borders), so the convolution's pad copy goes. Measured on bench/conv.py's
ResNet at batch 32 (bench/RESULTS.md, 2026-11-27 23:15-23:36): quantizes 10.8 -> 6.3
ms, pad copies 1.6 -> 0 (quiet), the forward 0.81x main's; conv.py 0.49-0.50x jax's.
Two earlier measured savings (bench/RESULTS.md, 2026-11-27 19:40-20:00): q holds 4 KQ
columns (`q_columns`: K / 4 rounded up to 16), not the packed 4 KB, the decode
regrouping the weights to match (K = 576 packs to 768, whose fourth plane is padding: a
quarter of the products were on zeros); and a patch
row's absmax is the max over its kernel's positions of a per-position map of max |x|
over the channels (`amax_map`, one small dispatch), the same number in KH KW reads
instead of K.

Needs: llvm-cpu on a host with AVX-512 VNNI, M a multiple of 16 (a static M, or a
symbolic one whose factor is: `m_multiple`), N a multiple of ROWS, 4 KB at most MAX_KP
(the decoded rows fit the stack). Where the table picks it: N at most 512 (at an LLM's
128 x 1536 x 4096 the avx512 kernel measured 4x faster).
"""
from __future__ import annotations

import numpy as np
import sympy
from iree.compiler import ir
from iree.compiler.dialects import arith, tensor

from ...ternary_pack import ACT_MAX
from ...codegen.builders import PARALLEL, generic
from ...codegen.executables import dispatch, ensure_executable
from ..template import render
from . import im2col_quant
from .avx2_quant import quant_literals

#: Rows of x a vector (one a lane) and so the multiple M must be.
LANES = 16
#: Weight rows a step: ROWS x BLOCKS accumulators, BLOCKS x vectors, ROWS broadcasts.
ROWS = 4
#: Blocks of 16 rows of x a step.
BLOCKS = 4
#: Steps of BLOCKS blocks a workgroup (the workgroup's x, 16 x BLOCKS x GROUPS rows of
#: KB x 4 bytes, is read from L2 once per ROWS weight rows).
GROUPS = 4
#: Blocks of 16 rows a workgroup of the quantize dispatch.
QUANT_BLOCKS = 4
#: The largest padded K: the decoded weight rows (ROWS x KB x 4 bytes) on the stack, 24
#: KiB at 6144, within IREE's 32 KiB default (3x3 at 512 channels: K = 4608).
MAX_KP = 6144


def m_multiple(m) -> int:
    """The largest integer factor known of a matmul's M: M itself when static, the
    coefficient of a symbolic one (1024*B -> 1024), 1 for anything else.

    >>> m_multiple(96), m_multiple(sympy.Symbol("B") * 1024), m_multiple("M")
    (96, 1024, 1)
    """
    if isinstance(m, (int, np.integer)):
        return int(m)
    if not isinstance(m, sympy.Expr):       # a name ("M"), or anything else: no factor known
        return 1
    coeff, _ = m.as_coeff_Mul()
    return int(coeff) if coeff.is_Integer and coeff > 0 else 1


def fits(m, k_bytes: int, n: int) -> bool:
    """Whether the kernel takes x [M, K] against a [N, KB] packed matrix (`m`: M as the
    IR holds it, static or symbolic)."""
    return m_multiple(m) % LANES == 0 and n % ROWS == 0 and 4 * k_bytes <= MAX_KP


def q_columns(k: int, kb: int) -> int:
    """KQ, the bytes a row of x takes in the kernel's q (4 KQ columns of K, a quarter in
    each plane): K / 4 rounded up to 16 where that is below the packed KB (K = 576 packs
    to KB = 192, three planes of K and one of zeros: KQ = 144, no products on the
    padding), else KB.

    >>> q_columns(576, 192), q_columns(1152, 320), q_columns(2304, 576), q_columns(27, 8)
    (144, 288, 576, 8)
    """
    quarter = (k + 3) // 4
    kq = (quarter + LANES - 1) // LANES * LANES
    return kq if kq < kb and kb % LANES == 0 else kb


def executable_text(name: str, n: int, kb: int, offset: bool = True, positions: int = 0,
                    kq: int | None = None) -> str:
    """The `stream.executable @name` (templates/ternary_avx512_tall.mlir): for q and stats
    from `quantize_text`'s dispatch, w [N, KB] i8 (the offset codes w + 1 when `offset`,
    else the signed codes) and `wscale` (the ternary scale / 127), out [M, N] f32 =
    dequant(act_quant(x) @ T^T); with `positions` P (x a convolution's patch rows, P a
    multiple of 16), out [M / P, N, P] (the same values, the convolution's layout).
    `kq` (`q_columns`, default KB): the bytes a row of q, whose columns the weights are
    regrouped to on decode."""
    return render("ternary_avx512_tall", name=name, n=n, kb=kb, kq=kq or kb, offset=offset,
                  positions=positions, rows=ROWS, blocks=BLOCKS, groups=GROUPS)


def quantize_text(name: str, kb: int, k: int, image, kernel, stride, dilation, out,
                  amap: bool = False) -> str:
    """The `stream.executable @name` (templates/ternary_lanes_quant.mlir) whose export
    quantizes the patch rows [N * OH * OW, k] of the padded input [N, C, HP, WP]
    (`image` = (C, HP, WP)) of a convolution with `kernel`, `stride`, `dilation` and
    output positions `out` (a plain x [M, k]: image (k, 1, 1), the rest 1) into the tall
    kernel's q and stats. With `amap` the export takes `amax_map`'s [N, HP, WP] after
    the input and each row's absmax is the max of its kernel's positions there."""
    (c, hp, wp), (kh, kw), (sh, sw), (dh, dw), (oh, ow) = image, kernel, stride, dilation, out
    contiguous = sw == 1 and ow % LANES == 0
    offsets = [(col // (kh * kw)) * hp * wp + (col % (kh * kw) // kw) * dh * wp + (col % kw) * dw
               for col in range(k)]
    return render("ternary_lanes_quant", name=name, kb=kb, k=k, c=c, hp=hp, wp=wp, kh=kh,
                  kw=kw, sh=sh, sw=sw, dh=dh, dw=dw, oh=oh, ow=ow, contiguous=contiguous,
                  segs=None if contiguous else segments(ow, sw), offsets=offsets, amap=amap,
                  blocks=QUANT_BLOCKS,
                  **{k: v for k, v in quant_literals().items() if k in ('eps', 'c127')})


def segments(ow: int, sw: int) -> dict | None:
    """How the quantize dispatch loads a column of a block of 16 patch rows without a
    gather, where they are runs of `w` output positions of one row each (OW a multiple of
    16: one run; OW = 4 or 8: 16 / OW rows): `count` loads of `span` floats (a power of
    two, masked to the `need` = (w - 1) sw + 1 a run reads when larger), every sw-th kept,
    merged pairwise by `steps` (dst, a, b, shuffle mask, len a, len b; loads are 0 ..
    count - 1, the last dst the column). None where a gather it stays (OW = 1: a plain
    x's rows, or OW not dividing 16).

    >>> segments(16, 2)['steps']
    [(1, 0, 0, [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30], 32, 32)]
    >>> [(d, a, b, n, m) for d, a, b, _, n, m in segments(4, 1)['steps']]
    [(4, 0, 1, 4, 4), (5, 2, 3, 4, 4), (6, 4, 5, 8, 8)]
    >>> segments(7, 1), segments(1, 1)
    (None, None)
    """
    if ow % LANES == 0:
        w, count = LANES, 1
    elif ow >= 4 and LANES % ow == 0:
        w, count = ow, LANES // ow
    else:
        return None
    need = (w - 1) * sw + 1
    span = 1 << (need - 1).bit_length()
    items = [(i, span, [j * sw for j in range(w)]) for i in range(count)]
    steps, nid = [], count
    if count == 1:
        steps.append((nid, 0, 0, items[0][2], span, span))
    while len(items) > 1:
        merged = []
        for (a, la, sa), (b, lb, sb) in zip(items[::2], items[1::2]):
            mask = sa + [la + i for i in sb]
            steps.append((nid, a, b, mask, la, lb))
            merged.append((nid, len(mask), list(range(len(mask)))))
            nid += 1
        items = merged
    return dict(count=count, w=w, span=span, need=need, masked=span != need, steps=steps)


def unpadded_text(name: str, kb: int, image, kernel, stride, dilation, out, pad) -> str:
    """The `stream.executable @name` (templates/ternary_lanes_quant_unpadded.mlir):
    `quantize_text`'s dispatch with `amap` reading the unpadded input [N, C, H, W]
    (`image` = (C, H, W)) of a convolution padded by `pad` = (top, left) (zeros by masked
    loads), for a KH x KW kernel (> 1) whose K = 4 kb and kb a multiple of KH KW, and
    `segments` of the output width and stride."""
    (c, h, w), (kh, kw), (sh, sw), (dh, dw), (oh, ow) = image, kernel, stride, dilation, out
    return render("ternary_lanes_quant_unpadded", name=name, kb=kb, c=c, h=h, w=w, kh=kh, kw=kw,
                  sh=sh, sw=sw, dh=dh, dw=dw, oh=oh, ow=ow, pt=pad[0], pl=pad[1],
                  segs=segments(ow, sw), blocks=QUANT_BLOCKS,
                  **{k: v for k, v in quant_literals().items() if k in ('eps', 'c127')})


def unpadded(xp: ir.Value):
    """(x, (top, left)) where the padded input xp [N, C, HP, WP] is x [N, C, H, W] (H and
    W static) put into zeros at static offsets (ops/conv.py's `_pad_input`: a
    tensor.insert_slice into a zero linalg.fill), else None."""
    if not hasattr(xp.owner, "name"):
        return None
    op = getattr(xp.owner, "operation", xp.owner)
    if op.name != "tensor.insert_slice":       # (a symbolic batch: its size an operand too)
        return None
    src, dest = op.operands[0], op.operands[1]
    offs = list(ir.DenseI64ArrayAttr(op.attributes["static_offsets"]))
    strides = list(ir.DenseI64ArrayAttr(op.attributes["static_strides"]))
    st = ir.RankedTensorType(src.type)
    if (len(offs) != 4 or offs[:2] != [0, 0] or min(offs) < 0 or strides != [1] * 4
            or st.rank != 4 or any(st.is_dynamic_dim(i) for i in (1, 2, 3))):
        return None
    if not hasattr(dest.owner, "name"):
        return None
    fill = getattr(dest.owner, "operation", dest.owner)
    if fill.name != "linalg.fill" or not hasattr(fill.operands[0].owner, "name"):
        return None
    cst = getattr(fill.operands[0].owner, "operation", fill.operands[0].owner)
    if cst.name != "arith.constant" or ir.FloatAttr(cst.attributes["value"]).value != 0.0:
        return None
    return src, (offs[2], offs[3])


def _index(v: int) -> ir.Value:
    return arith.constant(ir.IndexType.get(), v)


#: Chunks of 16 positions a workgroup of the absmax map's dispatch.
MAP_UNITS = 16


def amax_map(xp: ir.Value, nimg: ir.Value, dyn: bool) -> ir.Value:
    """[N * HP * WP] f32: max over the channels of |xp| at each position of the padded
    input xp [N, C, HP, WP] or [N, C, WP] (templates/ternary_amax_map.mlir; as a linalg reduction
    IREE put the channels innermost: a strided read, 20 ms at batch 32 against the
    quantize's own). A patch row's absmax is the max of this over the kernel's
    positions: the quantize dispatch reads KH KW values a row instead of C KH KW (a
    3x3x64 conv: 9 for 576)."""
    xt = ir.RankedTensorType(xp.type)
    c, hw = xt.get_dim_size(1), int(np.prod([xt.get_dim_size(i) for i in range(2, xt.rank)]))
    name = f"tern_amax_map_c{c}_hw{hw}"
    ensure_executable(name, lambda: render("ternary_amax_map", name=name, c=c, hw=hw,
                                           units=MAP_UNITS))
    flat_t = ir.RankedTensorType.get(
        [ir.ShapedType.get_dynamic_size() if dyn else xt.get_dim_size(0) * c * hw],
        xt.element_type)
    flat = tensor.collapse_shape(flat_t, xp, [list(range(xt.rank))])
    units = arith.muli(nimg, _index(-(-hw // LANES)))
    out_t = ir.RankedTensorType.get(
        [ir.ShapedType.get_dynamic_size() if dyn else xt.get_dim_size(0) * hw], xt.element_type)
    return dispatch(name, name, [units], [flat, nimg, units],
                    [arith.muli(nimg, _index(c * hw))] if dyn else [], out_t,
                    [arith.muli(nimg, _index(hw))] if dyn else [])


def quantized(kern, m: ir.Value, dims, found) -> list[ir.Value]:
    """[q, stats] of the matmul's x in the tall kernel's layout, typed as [M, 4 KQ] i8
    (KQ: `q_columns`) and [M, 2] f32 (the same bytes): from the padded
    input where x is a convolution's im2col (`found`: im2col_quant.patches_source of x),
    from the input before its padding (`unpadded`) where the kernel is > 1x1, K four
    whole planes of kernel positions and the rows of a block runs of output rows
    (`segments`), else from x."""
    if found is not None:
        xp, image, kernel, stride, dilation, out = found
        c, hp, wp = image
    else:
        xp, c, hp, wp = kern.x, kern.k, 1, 1
        kernel, stride, dilation, out = (1, 1), (1, 1), (1, 1), (1, 1)
    kq = q_columns(kern.k, kern.kb)
    amap = found is not None and kernel[0] * kernel[1] > 1
    xt = ir.RankedTensorType(xp.type)
    dyn = xt.is_dynamic_dim(0)
    un = (unpadded(xp) if amap and 4 * kq == kern.k and kq % (kernel[0] * kernel[1]) == 0
          and segments(out[1], stride[1]) is not None and xt.rank == 4 else None)
    if un is not None:
        return _quantized_unpadded(kern, m, dims, un, kq, kernel, stride, dilation, out, dyn)
    vol = c * hp * wp
    flat_t = ir.RankedTensorType.get(
        [ir.ShapedType.get_dynamic_size() if dyn else xt.get_dim_size(0) * vol], xt.element_type)
    flat = tensor.collapse_shape(flat_t, xp, [list(range(xt.rank))])
    nimg = tensor.dim(xp, _index(0)) if dyn else _index(xt.get_dim_size(0))
    arg_dims = [arith.muli(nimg, _index(vol))] if dyn else []
    geo = "x".join(map(str, (c, hp, wp))) + "_k%dx%d_s%dx%d_d%dx%d" % (*kernel, *stride, *dilation)
    name = f"tern_lanes_quant_{kq}_{kern.k}_c{geo}" + ("_amap" if amap else "")
    ensure_executable(name, lambda: quantize_text(name, kq, kern.k, (c, hp, wp), kernel,
                                                  stride, dilation, out, amap))
    args = [flat]
    if amap:
        args.append(amax_map(xp, nimg, dyn))
        arg_dims = arg_dims + ([arith.muli(nimg, _index(hp * wp))] if dyn else [])
    return dispatch(name, name, [m], [*args, nimg, m], arg_dims,
                    [kern.ttype([4 * kq], ir.IntegerType.get_signless(8)),
                     kern.ttype([2], kern.f32)], dims + dims)


def _quantized_unpadded(kern, m, dims, un, kq, kernel, stride, dilation, out, dyn):
    """`quantized`'s [q, stats] from the convolution's unpadded input (`un`: `unpadded`'s
    (x, pad)): the pad copy goes (bench/RESULTS.md: 3.2-3.9 ms of the ResNet's forward at
    batch 32)."""
    x, pad = un
    xt = ir.RankedTensorType(x.type)
    nimg = tensor.dim(x, _index(0)) if dyn else _index(xt.get_dim_size(0))
    c, h, w = (xt.get_dim_size(i) for i in (1, 2, 3))
    vol = c * h * w
    flat_t = ir.RankedTensorType.get(
        [ir.ShapedType.get_dynamic_size() if dyn else xt.get_dim_size(0) * vol], xt.element_type)
    flat = tensor.collapse_shape(flat_t, x, [[0, 1, 2, 3]])
    arg_dims = [arith.muli(nimg, _index(vol)), arith.muli(nimg, _index(h * w))] if dyn else []
    geo = "x".join(map(str, (c, h, w))) + "_k%dx%d_s%dx%d_d%dx%d_p%dx%d" % (
        *kernel, *stride, *dilation, *pad)
    name = f"tern_lanes_quant_{kq}_{kern.k}_c{geo}_unpadded"
    ensure_executable(name, lambda: unpadded_text(name, kq, (c, h, w), kernel, stride, dilation,
                                                  out, pad))
    return dispatch(name, name, [m], [flat, amax_map(x, nimg, dyn), nimg, m], arg_dims,
                    [kern.ttype([4 * kq], ir.IntegerType.get_signless(8)),
                     kern.ttype([2], kern.f32)], dims + dims)


def emit(kern) -> ir.Value:
    """y [M, N] f32 for the `TernaryBuilder` `kern` (activation quantization on): the
    quantize dispatch, then the tall matmul's."""
    offset = kern.codes == "offset"
    found = im2col_quant.patches_source(kern.x)
    positions = found[-1][0] * found[-1][1] if found is not None else 0
    if positions % LANES:
        positions = 0
    kq = q_columns(kern.k, kern.kb)
    name = (f"tern_avx512_tall_{kern.n}x{kern.kb}{'_offset' if offset else ''}"
            + (f"_q{kq}" if kq != kern.kb else "") + (f"_p{positions}" if positions else ""))
    ensure_executable(name, lambda: executable_text(name, kern.n, kern.kb, offset, positions, kq))
    m = kern.m_values[0] if kern.m_values else arith.constant(kern.index, kern.m)
    dims = list(kern.m_values)
    x = quantized(kern, m, dims, found)
    wscale = arith.constant(kern.f32, float(np.float32(kern.scale / ACT_MAX)))
    args = [*x, kern.weights(), wscale, m]
    if not positions:
        return dispatch(name, name, [m], args, dims * len(x), kern.ttype([kern.n], kern.f32), dims)
    # the convolution's [images, N, P] from the kernel, viewed as [M, N] by a transpose
    # that the transpose back to NCHW after the matmul (nn.BitConv2d's) cancels in IREE
    nimg = [arith.divui(m, _index(positions))] if dims else []
    imgs = ir.ShapedType.get_dynamic_size() if dims else kern.m // positions
    y = dispatch(name, name, [m], args, dims * len(x),
                 ir.RankedTensorType.get([imgs, kern.n, positions], kern.f32), nimg)
    t_type = ir.RankedTensorType.get([imgs, positions, kern.n], kern.f32)
    init = tensor.empty([*nimg, positions, kern.n] if dims else [imgs, positions, kern.n], kern.f32)
    maps = [ir.AffineMap.get(3, 0, [ir.AffineDimExpr.get(d) for d in dd]) for dd in ((0, 2, 1), (0, 1, 2))]
    yt = generic(t_type, [y], init, maps, [PARALLEL] * 3, lambda v, _acc: v)
    return tensor.collapse_shape(kern.ttype([kern.n], kern.f32), yt, [[0, 1], [2]])
