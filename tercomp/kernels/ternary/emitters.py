"""What each ternary_matmul row of the kernel table (kernels/table.py) emits: a kernel is
a function `(TernaryBuilder, act_quant) -> y`, wrapped as the row's `emit` by
`TernaryEmit`. The table gives an op a row only where the row's `fits` accepts its
shape, so no kernel here checks its shape again or falls back to another.

Without activation quantization there are no int8 activations to multiply: the integer
kernels (avx512, avx2, vnni, blocked, and the dispatches over them) emit the exact f32
masked add/sub kernel on the same 2-bit constant, as `addsub` does (`float_without_quant`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from iree.compiler import ir
from iree.compiler.dialects import arith, scf

from ...codegen.builders import const
from ...errors import VerifyError
from . import amx, avx2, avx512, avx512_tall
from .blocked import blocked
from .builder import TernaryBuilder, check_packed
from .vnni import vnni

#: The largest M the ternary dispatch strategies send to their decode kernel.
GEMV_MAX_M = 4

Kernel = Callable[[TernaryBuilder, bool], ir.Value]


def f32(kern: TernaryBuilder, act_quant: bool) -> ir.Value:
    """exact f32 masked add/sub (on the quantized x with `act_quant`)"""
    return kern.addsub(integer=False, act_quant=act_quant)


def addsub(kern: TernaryBuilder, act_quant: bool) -> ir.Value:
    return kern.addsub(integer=act_quant, act_quant=act_quant)


def int8(kern: TernaryBuilder, act_quant: bool) -> ir.Value:
    return kern.int8_matmul(act_quant)


def float_without_quant(kernel: Callable[[TernaryBuilder], ir.Value]) -> Kernel:
    """An integer-only kernel, and the f32 kernel where there is no activation
    quantization (no int8 activations to multiply)."""
    return lambda kern, act_quant: kernel(kern) if act_quant else f32(kern, act_quant)


def dispatch(small: Kernel, large: Kernel) -> Kernel:
    """scf.if on the batch size, `small` for M <= GEMV_MAX_M and `large` above; both read
    the same 2-bit constant (a static M gets its branch directly)."""
    def emit(kern: TernaryBuilder, aq: bool) -> ir.Value:
        if kern.m is not None:
            return (small if kern.m <= GEMV_MAX_M else large)(kern, aq)
        kern.pin_weights()      # else IREE folds each branch's view into its own constant
        is_small = arith.cmpi(arith.CmpIPredicate.ule, kern.m_values[0],
                              const(GEMV_MAX_M, kern.index))
        branch = scf.IfOp(is_small, [kern.ttype([kern.n], kern.f32)], has_else=True)
        with ir.InsertionPoint(branch.then_block):
            scf.YieldOp([small(kern, aq)])
        with ir.InsertionPoint(branch.else_block):
            scf.YieldOp([large(kern, aq)])
        return branch.results[0]
    return emit


AVX512 = float_without_quant(avx512.emit)
AMX = float_without_quant(amx.emit)
AVX512_TALL = float_without_quant(avx512_tall.emit)
AVX2 = float_without_quant(avx2.emit)
VNNI = float_without_quant(vnni)
BLOCKED = float_without_quant(blocked)
DISPATCH_VNNI = dispatch(VNNI, BLOCKED)
DISPATCH = dispatch(addsub, BLOCKED)


def checked(x: ir.Value, packed, k: int, n: int):
    """(M, or None when dynamic; the packed weights) of a ternary matmul's x and packed
    weights, or a TercompError saying what is wrong with them."""
    packed = check_packed(packed, k, n)
    x_type = ir.RankedTensorType(x.type)
    if (x_type.rank != 2 or x_type.is_dynamic_dim(1) or x_type.get_dim_size(1) != k
            or not isinstance(x_type.element_type, ir.F32Type)):
        raise VerifyError(f"ternary matmul expects x of type tensor<?x{k}xf32> (M static "
                          f"or dynamic), got {x_type}")
    return (None if x_type.is_dynamic_dim(0) else x_type.get_dim_size(0)), packed


def emit(kernel: Kernel, x: ir.Value, packed, k: int, n: int, scale: float, *,
         act_quant: bool, codes: str = "signed", m: int | None = None) -> ir.Value:
    """`y = scale * x @ T^T` by `kernel` at the current insertion point, for x and packed
    weights that `checked` took (`m`: what it gave)."""
    return kernel(TernaryBuilder(x, m, k, n, packed, float(scale), codes), act_quant)


@dataclass(frozen=True)
class TernaryEmit:
    """The `emit` of a ternary_matmul row: `kernel(TernaryBuilder, act_quant) -> y`, called
    on a tern op's operands (x, packed) and attributes. The packed weights arrive as an
    arith.constant (frozen at compile time), a util.global.load (.irpa parameters) or a
    function argument; every kernel reads any of them."""
    kernel: Kernel

    def __call__(self, ctx, op, operands) -> list:
        a = op.attrs
        k, n = int(a["k"]), int(a["n"])
        m, packed = checked(operands[0], operands[1], k, n)
        return [emit(self.kernel, operands[0], packed, k, n, float(a["scale"]),
                     act_quant=bool(a["act_quant"]), codes=a.get("codes", "signed"), m=m)]
