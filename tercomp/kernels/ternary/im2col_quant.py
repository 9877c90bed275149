"""The patches of a convolution quantized in one dispatch (templates/ternary_im2col_quant.mlir)
for the avx2 and avx512 ternary kernels: where the x of a ternary matmul is the im2col
of a convolution (nn.BitConv1d/2d: tern.im2col, reshaped to [N * P, C * K]), the
quantize dispatch reads the padded input itself, a gather of 16 patch columns at a time,
instead of the im2col generic's f32 patches (K floats a row: 9x the input for a 3x3
kernel, written and read back once each). At batch 32 of bench/conv.py's ResNet the
im2col generic and the quantize dispatch of a 64-channel 3x3 layer at 32x32 took
longer than its matmul (bench/RESULTS.md).

It applies where the im2col generic (ops/im2col.py, marked with its stride and
dilation) feeds the matmul through the one collapse to [N * P, C * K], K is a multiple
of 16 and at most MAX_K (its offset table and row buffer fit the dispatch's stack);
elsewhere the quantize dispatch reads x as it is.
"""
from __future__ import annotations

from iree.compiler import ir
from iree.compiler.dialects import arith, tensor

from ...codegen.executables import dispatch, ensure_executable
from ..template import render
from .avx2_quant import quant_literals

#: Rows of the patch matrix per workgroup.
ROWS = 16
#: Columns a gather reads (K must be a multiple).
LANES = 16
#: The largest K: its offset table (4 K bytes) lives on the dispatch's stack, within
#: IREE's 32 KiB default (3x3 at 512 channels: 18 KiB).
MAX_K = 6144

#: The discardable attribute that marks tern.im2col's generic lowering (ops/im2col.py
#: writes it: its stride and dilation), which `patches_source` looks for.
PATCHES_ATTR = "tern.im2col"


def _owner(v: ir.Value):
    owner = v.owner
    return getattr(owner, "operation", owner)


def patches_source(x: ir.Value):
    """(xp, (C, HP, WP), kernel, stride, dilation, out) where x [M, K] is the collapsed
    im2col generic of the padded input xp [N, C, *padded] (1-D convolutions as 2-D ones
    of height 1), else None."""
    if not isinstance(x.owner, (ir.Operation, ir.OpView)) and not hasattr(x.owner, "name"):
        return None
    col = _owner(x)
    if col.name != "tensor.collapse_shape":
        return None
    gen_v = col.operands[0]
    if not hasattr(gen_v.owner, "name"):
        return None
    gen = _owner(gen_v)
    if gen.name != "linalg.generic" or PATCHES_ATTR not in gen.attributes:
        return None
    marks = ir.DictAttr(gen.attributes[PATCHES_ATTR])
    stride = [ir.IntegerAttr(a).value for a in ir.ArrayAttr(marks["stride"])]
    dilation = [ir.IntegerAttr(a).value for a in ir.ArrayAttr(marks["dilation"])]
    nd = len(stride)
    xp = gen.operands[0]
    xt, gt = ir.RankedTensorType(xp.type), ir.RankedTensorType(gen_v.type)
    ct = ir.RankedTensorType(x.type)
    if nd not in (1, 2) or gt.rank != 2 + 2 * nd or ct.rank != 2 or xt.rank != 2 + nd:
        return None
    g = [gt.get_dim_size(i) for i in range(1, gt.rank)]         # *P, C, *K
    out, c, kernel = g[:nd], g[nd], g[nd + 1:]
    if ct.is_dynamic_dim(1) or ct.get_dim_size(1) != c * _prod(kernel):
        return None
    # the collapse must be [[0, *P], [C, *K]]
    reassoc = [[ir.IntegerAttr(i).value for i in ir.ArrayAttr(group)]
               for group in ir.ArrayAttr(col.attributes["reassociation"])]
    if reassoc != [list(range(nd + 1)), list(range(nd + 1, 2 + 2 * nd))]:
        return None
    padded = [xt.get_dim_size(2 + i) for i in range(nd)]
    if nd == 1:
        padded, kernel, stride, dilation, out = ([1] + padded, [1] + kernel, [1] + stride,
                                                 [1] + dilation, [1] + out)
    return xp, (c, *padded), kernel, stride, dilation, out


def _prod(v):
    r = 1
    for d in v:
        r *= d
    return r


def quantize_text(name: str, kb: int, image, kernel, stride, dilation, out) -> str:
    """The `stream.executable @name` (templates/ternary_im2col_quant.mlir) whose export
    quantizes the patches of the padded input [N, C, HP, WP] (`image` = (C, HP, WP)) of a
    convolution with `kernel`, `stride`, `dilation` (pairs) and output positions `out`
    into q [N * OH * OW, 4 KB] i8 and stats [N * OH * OW, 2] f32, ROWS rows a workgroup."""
    (c, hp, wp), (kh, kw), (sh, sw), (dh, dw), (oh, ow) = image, kernel, stride, dilation, out
    return render("ternary_im2col_quant", name=name, kb=kb, k=c * kh * kw, c=c, hp=hp, wp=wp,
                  kh=kh, kw=kw, sh=sh, sw=sw, dh=dh, dw=dw, oh=oh, ow=ow, rows=ROWS,
                  **quant_literals())


def quantized(kern, m: ir.Value, dims) -> list[ir.Value] | None:
    """[q, stats] of the ternary matmul's x (as avx2_quant.quantized gives them) by one
    dispatch over the convolution's padded input, where x is the im2col of one (see the
    module docstring); None elsewhere."""
    found = patches_source(kern.x)
    k = kern.k
    if found is None or k % LANES or k > MAX_K:
        return None
    xp, (c, hp, wp), (kh, kw), (sh, sw), (dh, dw), (oh, ow) = found
    vol = c * hp * wp
    xt = ir.RankedTensorType(xp.type)
    index = ir.IndexType.get()
    n_dyn = xt.is_dynamic_dim(0)
    n_static = xt.get_dim_size(0)
    flat_t = ir.RankedTensorType.get([n_static * vol if not n_dyn else ir.ShapedType.get_dynamic_size()],
                                     xt.element_type)
    flat = tensor.collapse_shape(flat_t, xp, [list(range(xt.rank))])
    if n_dyn:
        nimg = tensor.dim(xp, _index_const(0))
        arg_dims = [arith.muli(nimg, _index_const(vol))]
    else:
        nimg = arith.constant(index, n_static)
        arg_dims = []
    name = (f"tern_im2col_quant_{kern.kb}_c{c}x{hp}x{wp}_k{kh}x{kw}_s{sh}x{sw}_d{dh}x{dw}")
    ensure_executable(name, lambda: quantize_text(name, kern.kb, (c, hp, wp), (kh, kw),
                                                  (sh, sw), (dh, dw), (oh, ow)))
    return dispatch(name, name, [m], [flat, nimg, m], arg_dims,
                    [kern.ttype([4 * kern.kb], ir.IntegerType.get_signless(8)),
                     kern.ttype([2], kern.f32)], dims + dims)


def _index_const(v: int) -> ir.Value:
    return arith.constant(ir.IndexType.get(), v)
