"""Ternary (BitNet b1.58) ops: round, ternarize, act_quant and ternary_matmul.

* ``round(x)``: round half to even (np.rint), no gradient.
* ``ternarize(w) {scale?}``: absmean ternary fake-quantization, ``clip(rint(w/s), -1, 1) * s``
  with ``s = max(mean|w|, 1e-5)`` over the whole tensor, or ``s = scale`` when the attribute
  is given (a stored ternary weight keeps its own scale); straight-through gradient.
* ``act_quant(x)``: per-row (last axis) absmax int8 fake-quantization, ``xq / s``;
  straight-through gradient.
* ``ternary_weight(packed) {k, scale}``: the f32 weights ``scale * T`` [N, K] of a packed
  i8 [N, KB] ternary matrix: how a stored ternary weight (`nn.BitLinear.from_ternary`)
  enters the IR, so that no f32 copy of it is made while tracing; the `ternary` pass
  hands its packed bytes to ternary_matmul unchanged. Not differentiable (frozen).
* ``ternary_pack(t) {codes}``: the packed i8 [N, KB] 2-bit planar codes (``codes``:
  "signed" or "offset") of the signs of a ternarized matrix t [N, K] (values in {-s, 0,
  s}): how the `ternary` pass gives a kernel the weights of a matmul whose ternarized
  weight is computed at run time (a training step's, a gradient's). Not differentiable.
* ``ternary_matmul(x, packed) {k, n, scale, strategy, act_quant, codes}``:
  ``y[M, N] = scale * x @ T^T`` with T ternary, packed 2-bit planar as an i8 tensor
  [N, KB] (see ternary_pack) in the "signed" codes, or, with ``codes = "offset"``, the
  codes w + 1 that the ternary pass stores for a kernel that reads them. No lowering of
  its own: the row of the kernel table its strategy names emits it (kernels/ternary/),
  so the `ternary` or `kernels` pass must settle "auto" first. Inference only.
"""
from __future__ import annotations

import numpy as np
from iree.compiler import ir
from iree.compiler.dialects import arith, linalg, math, tensor

from ..errors import TraceError
from ..ir import TensorType
from ..ir.types import is_float
from ..codegen.builders import PARALLEL, REDUCTION, affine_map, generic
from ..kernels.ternary.builder import unpack_codes
from ..kernels.table import check_attr
from .. import ternary_pack as tp
from .registry import OpDef, REQUIRED, register


def _float_same(name):
    def infer(types, a):
        t = types[0]
        if not is_float(t.dtype):
            raise TraceError(f"{name} needs a floating-point operand, got {t.dtype}",
                             hint="cast the operand to float32 first")
        if name != "round" and t.rank < 1:
            raise TraceError(f"{name} needs an operand of rank >= 1, got a scalar")
        return [t]
    return infer


def _straight_through(b, op, cts):
    return [cts[0]]


# -- round -----------------------------------------------------------------------------
def _round_lower(ctx, op, operands):
    t = op.operands[0].type
    return [ctx.elementwise(operands, [t], op.results[0].type,
                            lambda v: math.RoundEvenOp(v).result)]


register(OpDef("round", "elementwise", _float_same("round"),
               lambda xs, a: [np.rint(xs[0]).astype(xs[0].dtype)],
               lower=_round_lower, vjp=None, differentiable=False,
               doc="round half to even"))


# -- ternarize ---------------------------------------------------------------------------
def _ternarize_reference(xs, a):
    w = xs[0]
    w2 = w.reshape(-1, w.shape[-1]) if w.ndim >= 2 else w.reshape(1, -1)
    fixed = a.get("scale")
    t, s = tp.absmean_ternarize(w2) if fixed is None else tp.ternarize_with_scale(w2, fixed)
    return [(t.astype(np.float64) * np.float64(s)).astype(w.dtype).reshape(w.shape)]


def _ternarize_decompose(b, operands, attrs):
    (w,) = operands
    dt = w.dtype
    if attrs.get("scale") is not None:
        s = b.scalar(float(attrs["scale"]), dt)
    else:
        m = b.mean(b.abs(w), axes=list(range(w.type.rank)), keepdims=True)
        s = b.maximum(m, b.scalar(tp.SCALE_EPS, dt))
    r = b.div(w, s)
    one, zero = b.scalar(1.0, dt), b.scalar(0.0, dt)
    # clip(rint(r), -1, 1): rint(+-0.5) = 0, so strict comparisons are exact. A literal
    # -1, not neg(1): IREE would hoist that expression into a global and JIT-compile a
    # module at compile time to evaluate it.
    t = b.where(b.gt(r, b.scalar(0.5, dt)), one,
                b.where(b.lt(r, b.scalar(-0.5, dt)), b.scalar(-1.0, dt), zero))
    return b.mul(t, s)


register(OpDef("ternarize", "ternary", _float_same("ternarize"), _ternarize_reference,
               attrs={"scale": None}, decompose=_ternarize_decompose, vjp=_straight_through,
               doc="absmean (or fixed-scale) ternary fake-quantization (straight-through "
                   "gradient)"))


# -- act_quant ----------------------------------------------------------------------------
def _act_quant_reference(xs, a):
    xq, s = tp.act_quant(xs[0])
    return [(xq / s).astype(xs[0].dtype)]


def _act_quant_decompose(b, operands, attrs):
    (x,) = operands
    dt = x.dtype
    amax = b.max(b.abs(x), axes=[x.type.rank - 1], keepdims=True)
    top = float(tp.ACT_MAX)
    s = b.div(b.scalar(top, dt), b.maximum(amax, b.scalar(tp.ACT_EPS, dt)))
    xq = b.minimum(b.maximum(b.round(b.mul(x, s)), b.scalar(-top, dt)), b.scalar(top, dt))
    return b.div(xq, s)


register(OpDef("act_quant", "ternary", _float_same("act_quant"), _act_quant_reference,
               decompose=_act_quant_decompose, vjp=_straight_through,
               doc="per-row absmax int8 fake-quantization (straight-through gradient)"))


# -- ternary_weight ---------------------------------------------------------------------
def _tw_infer(types, a):
    (p,) = types
    k = int(a["k"])
    if p.rank != 2 or p.dtype not in ("i8", "u8") or not p.is_static or 4 * p.shape[1] < k or k < 1:
        raise TraceError(f"ternary_weight expects static packed weights [N, KB] i8 with "
                         f"4*KB >= k = {k}, got {p.mlir()}")
    if not float(a["scale"]) > 0:
        raise TraceError(f"ternary_weight: the scale must be positive, got {a['scale']}")
    return [TensorType((p.shape[0], k), "f32")]


def _tw_reference(xs, a):
    t = tp.unpack_ternary(np.asarray(xs[0]).view(np.uint8), int(a["k"]))
    return [t.astype(np.float32) * np.float32(a["scale"])]


def _tw_lower(ctx, op, operands):
    (p,) = op.operands
    n, kb = p.type.shape
    k, f32 = int(op.attrs["k"]), ir.F32Type.get()
    t = unpack_codes(operands[0], n, kb, f32)
    if 4 * kb != k:
        t = tensor.extract_slice(ir.RankedTensorType.get([n, k], f32), t, [], [], [],
                                 [0, 0], [n, k], [1, 1])
    w, scale = op.results[0].type, float(np.float32(op.attrs["scale"]))
    return [ctx.elementwise([t], [w], w, lambda v: arith.mulf(v, arith.constant(f32, scale)))]


register(OpDef("ternary_weight", "ternary", _tw_infer, _tw_reference, num_operands=1,
               attrs={"k": REQUIRED, "scale": REQUIRED}, lower=_tw_lower, vjp=None,
               differentiable=False, nondiff_operands=(0,),
               doc="the f32 weights scale * T [N, K] of a packed 2-bit ternary matrix"))


# -- ternary_pack --------------------------------------------------------------------------
def _tp_infer(types, a):
    (t,) = types
    if t.rank != 2 or t.dtype != "f32" or not t.is_static:
        raise TraceError(f"ternary_pack expects a static f32 matrix [N, K], got {t.mlir()}")
    if a.get("codes") not in tp.CODES:
        raise TraceError(f"unknown ternary code format {a.get('codes')!r}; expected one of "
                         f"{', '.join(map(repr, tp.CODES))}")
    n, k = (int(d) for d in t.shape)
    return [TensorType((n, tp.padded_k(k) // 4), "i8")]


def _tp_reference(xs, a):
    packed = tp.pack_ternary(np.sign(np.asarray(xs[0])).astype(np.int8))
    return [(tp.to_offset_codes(packed) if a["codes"] == "offset" else packed).view(np.int8)]


def _tp_lower(ctx, op, operands):
    """Zero-pad t to [N, KP], view it [N, 4, KB], and OR each plane's 2-bit code into the
    byte (a reduction over the 4 planes): code = 0b01 / 0b10 / 0b00 for t > 0 / t < 0 / 0
    ("signed"), t's sign + 1 ("offset")."""
    (t,) = op.operands
    n, k = (int(d) for d in t.type.shape)
    kb = op.results[0].type.shape[1]
    f32, i8 = ir.F32Type.get(), ir.IntegerType.get_signless(8)
    x = operands[0]
    if 4 * kb != k:
        zero = arith.constant(f32, 0.0)
        x = tensor.PadOp(ir.RankedTensorType.get([n, 4 * kb], f32), x, [], [], [0, 0], [0, 4 * kb - k])
        block = x.regions[0].blocks.append(ir.IndexType.get(), ir.IndexType.get())
        with ir.InsertionPoint(block):
            tensor.YieldOp(zero)
        x = x.result
    planes = tensor.expand_shape(ir.RankedTensorType.get([n, 4, kb], f32), x, [[0], [1, 2]],
                                 [], [n, 4, kb])
    pos, neg, nil = ((2, 0, 1) if op.attrs["codes"] == "offset" else (1, 2, 0))

    def body(v, acc):
        j = arith.index_cast(i8, linalg.IndexOp(2).result)
        zero = arith.constant(f32, 0.0)
        c = arith.select(arith.cmpf(arith.CmpFPredicate.OGT, v, zero), arith.constant(i8, pos),
                         arith.select(arith.cmpf(arith.CmpFPredicate.OLT, v, zero),
                                      arith.constant(i8, neg), arith.constant(i8, nil)))
        return arith.ori(acc, arith.shli(c, arith.shli(j, arith.constant(i8, 1))))

    init = ctx.fill(op.results[0].type, 0)
    return [generic(ir.RankedTensorType.get([n, kb], i8), [planes], init,
                    [affine_map(3, [0, 2, 1]), affine_map(3, [0, 1])],
                    [PARALLEL, PARALLEL, REDUCTION], body)]


register(OpDef("ternary_pack", "ternary", _tp_infer, _tp_reference, num_operands=1,
               attrs={"codes": REQUIRED}, lower=_tp_lower, vjp=None, differentiable=False,
               nondiff_operands=(0,), foldable=False,
               doc="the packed 2-bit codes [N, KB] of a ternarized matrix's signs"))


# -- ternary_matmul ------------------------------------------------------------------------


def _tm_infer(types, a):
    x, p = types
    k, n = int(a["k"]), int(a["n"])
    if x.rank != 2 or x.dtype != "f32" or x.shape[1] != k:
        raise TraceError(f"ternary_matmul expects x of type [M, {k}] f32, got {x.mlir()}")
    if p.rank != 2 or p.dtype not in ("i8", "u8") or p.shape[0] != n or 4 * p.shape[1] < k:
        raise TraceError(f"ternary_matmul expects packed weights [{n}, KB] i8 with 4*KB >= {k}, "
                         f"got {p.mlir()}")
    if a.get("codes", "signed") not in tp.CODES:
        raise TraceError(f"unknown ternary code format {a['codes']!r}; expected one of "
                         f"{', '.join(map(repr, tp.CODES))}")
    check_attr("ternary_matmul", types, a)
    return [TensorType((x.shape[0], n), "f32")]


def _tm_reference(xs, a):
    x, p = xs
    return [tp.ternary_matmul_reference(x, np.asarray(p).view(np.uint8), int(a["k"]),
                                        float(a["scale"]), bool(a["act_quant"]),
                                        a.get("codes", "signed"))]


register(OpDef("ternary_matmul", "ternary", _tm_infer, _tm_reference, num_operands=2,
               attrs={"k": REQUIRED, "n": REQUIRED, "scale": REQUIRED, "strategy": "auto",
                      "act_quant": True, "codes": None},
               vjp=None, differentiable=False, nondiff_operands=(0, 1),
               doc="y = scale * x @ T^T with T ternary, packed 2-bit planar"))
