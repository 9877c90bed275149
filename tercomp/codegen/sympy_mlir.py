"""Emit a sympy expression as arith/math ops on scalars (the body of a linalg.generic).

This is how every elementwise op is lowered: the op's sympy expression, with its
symbols bound to the generic's block arguments, becomes the region body
(`SympyWalker(ArithBackend(env, dtype)).emit(expr)`).
"""
from __future__ import annotations

from iree.compiler import ir
from iree.compiler.dialects import arith, math

from ..sympy_walk import Backend
from .builders import scalar_const

_CMPF = {"eq": 1, "gt": 2, "ge": 3, "lt": 4, "le": 5, "ne": 13}    # oeq ogt oge olt ole une
_CMPF_UNO = 14      # true if either operand is NaN
_CMPI = {"eq": 0, "ne": 1, "lt": 2, "le": 3, "gt": 4, "ge": 5}     # eq ne slt sle sgt sge
_MATH = {"exp": math.ExpOp, "log": math.LogOp, "tanh": math.TanhOp, "sin": math.SinOp,
         "cos": math.CosOp, "sqrt": math.SqrtOp, "rsqrt": math.RsqrtOp, "exp2": math.Exp2Op}


def _pred(code: int) -> ir.IntegerAttr:
    return ir.IntegerAttr.get(ir.IntegerType.get_signless(64), code)


class ArithBackend(Backend):
    """Scalars of `dtype`; `env` maps the expression's sympy Symbols to ir.Values."""

    def __init__(self, env: dict, dtype: str):
        self.env = env
        self.dtype = dtype
        self.is_float = dtype.startswith("f")

    def number(self, n):
        return scalar_const(float(n) if self.is_float else int(n), self.dtype)

    def symbol(self, s):
        return self.env[s]

    def add(self, a, b):
        return arith.AddFOp(a, b).result if self.is_float else arith.AddIOp(a, b).result

    def sub(self, a, b):
        return arith.SubFOp(a, b).result if self.is_float else arith.SubIOp(a, b).result

    def mul(self, a, b):
        return arith.MulFOp(a, b).result if self.is_float else arith.MulIOp(a, b).result

    def div(self, a, b):
        return arith.DivFOp(a, b).result

    def neg(self, a):
        return arith.NegFOp(a).result if self.is_float else arith.SubIOp(self.number(0), a).result

    def divides(self, exp):
        return self.is_float

    def pow(self, x, exponent):
        return math.PowFOp(x, self.number(exponent)).result

    def call(self, name, *args):
        (x,) = args
        if name == "abs":
            return math.AbsFOp(x).result if self.is_float else math.AbsIOp(x).result
        if name == "sign":
            z, one = self.number(0), self.number(1)
            pos = self.compare("gt", x, z)
            neg = self.compare("lt", x, z)
            return arith.SelectOp(pos, one, arith.SelectOp(neg, self.neg(one), z).result).result
        return _MATH[name](x).result

    def compare(self, name, a, b):
        if self.is_float:
            return arith.CmpFOp(_pred(_CMPF[name]), a, b).result
        return arith.CmpIOp(_pred(_CMPI[name]), a, b).result

    def select(self, cond, a, b):
        return arith.SelectOp(cond, a, b).result

    def keep_nan(self, operands, acc):
        """A comparison with NaN is false, so a select on it would drop the NaN
        (maximum(NaN, 1) = 1): where an operand of a condition is NaN, the result is
        their sum, which is NaN, as in NumPy."""
        if not self.is_float or not operands:
            return acc
        nan = total = None
        for a, b in operands:
            uno = arith.CmpFOp(_pred(_CMPF_UNO), a, b).result
            s = self.add(a, b)
            nan = uno if nan is None else arith.OrIOp(nan, uno).result
            total = s if total is None else self.add(total, s)
        return arith.SelectOp(nan, total, acc).result

    def unsupported(self, e):
        return NotImplementedError(f"cannot lower sympy expression {e} ({e.func})")
