"""Print a sympy expression as arith/math ops on scalars (the body of a linalg.generic).

This is how every elementwise op is lowered: the op's sympy expression, with its
symbols bound to the generic's block arguments, becomes the region body.
"""
from __future__ import annotations

import sympy
from iree.compiler import ir
from iree.compiler.dialects import arith, math

from .builders import scalar_const

_CMPF = {sympy.StrictLessThan: "olt", sympy.LessThan: "ole", sympy.StrictGreaterThan: "ogt",
         sympy.GreaterThan: "oge", sympy.Equality: "oeq", sympy.Unequality: "une"}
_CMPI = {sympy.StrictLessThan: "slt", sympy.LessThan: "sle", sympy.StrictGreaterThan: "sgt",
         sympy.GreaterThan: "sge", sympy.Equality: "eq", sympy.Unequality: "ne"}
_CMPF_CODE = {"oeq": 1, "ogt": 2, "oge": 3, "olt": 4, "ole": 5, "une": 13}
_CMPF_UNO = 14      # true if either operand is NaN
_CMPI_CODE = {"eq": 0, "ne": 1, "slt": 2, "sle": 3, "sgt": 4, "sge": 5}
_UNARY_MATH = {sympy.exp: math.ExpOp, sympy.log: math.LogOp, sympy.tanh: math.TanhOp,
               sympy.Abs: None, sympy.cos: math.CosOp, sympy.sin: math.SinOp}


class SympyToArith:
    """Emit `expr` with `env` mapping sympy Symbols to scalar ir.Values of `dtype`."""

    def __init__(self, env: dict, dtype: str):
        self.env = env
        self.dtype = dtype
        self.is_float = dtype.startswith("f")
        self.cache: dict = {}

    def const(self, v):
        return scalar_const(v, self.dtype)

    def emit(self, e):
        if e in self.cache:
            return self.cache[e]
        v = self._emit(e)
        self.cache[e] = v
        return v

    def _emit(self, e):
        if isinstance(e, sympy.Symbol):
            return self.env[e]
        if e.is_number:
            return self.const(float(e) if self.is_float else int(e))
        if isinstance(e, sympy.Add):
            terms = list(e.args)
            acc = self.emit(terms[0])
            for t in terms[1:]:
                c, rest = t.as_coeff_Mul()
                if c == -1:
                    acc = self._sub(acc, self.emit(rest))
                else:
                    acc = self._add(acc, self.emit(t))
            return acc
        if isinstance(e, sympy.Mul):
            c, rest = e.as_coeff_Mul()
            if c == -1:
                return self._neg(self.emit(rest))
            num, den = [], []
            for f in e.args:
                if isinstance(f, sympy.Pow) and f.exp.is_Number and f.exp < 0 and self.is_float:
                    den.append(f.base ** (-f.exp))
                else:
                    num.append(f)
            acc = self.emit(num[0]) if num else self.const(1.0)
            for f in num[1:]:
                acc = self._mul(acc, self.emit(f))
            for f in den:
                acc = arith.DivFOp(acc, self.emit(f)).result
            return acc
        if isinstance(e, sympy.Pow):
            return self._pow(e.base, e.exp)
        if isinstance(e, sympy.Abs):
            x = self.emit(e.args[0])
            return math.AbsFOp(x).result if self.is_float else math.AbsIOp(x).result
        if isinstance(e, sympy.sign):
            x = self.emit(e.args[0])
            z, one = self.const(0), self.const(1)
            pos = self._cmp("ogt", "sgt", x, z)
            neg = self._cmp("olt", "slt", x, z)
            return arith.SelectOp(pos, one, arith.SelectOp(neg, self._neg(one), z).result).result
        if e.func in _UNARY_MATH and _UNARY_MATH[e.func] is not None:
            return _UNARY_MATH[e.func](self.emit(e.args[0])).result
        if isinstance(e, (sympy.Max, sympy.Min)):
            if isinstance(e, sympy.Max):
                op = arith.MaximumFOp if self.is_float else arith.MaxSIOp
            else:
                op = arith.MinimumFOp if self.is_float else arith.MinSIOp
            acc = self.emit(e.args[0])
            for a in e.args[1:]:
                acc = op(acc, self.emit(a)).result
            return acc
        if isinstance(e, sympy.Piecewise):
            *cases, (last, cond) = e.args
            acc = self.emit(last)
            for val, c in reversed(cases):
                acc = arith.SelectOp(self.emit_cond(c), self.emit(val), acc).result
            return self._keep_nan(e, acc) if self.is_float else acc
        raise NotImplementedError(f"cannot lower sympy expression {e} ({e.func})")

    def emit_cond(self, c):
        if c is sympy.true:
            return scalar_const(1, "i1")
        if isinstance(c, sympy.And):
            acc = self.emit_cond(c.args[0])
            for a in c.args[1:]:
                acc = arith.AndIOp(acc, self.emit_cond(a)).result
            return acc
        if isinstance(c, sympy.Or):
            acc = self.emit_cond(c.args[0])
            for a in c.args[1:]:
                acc = arith.OrIOp(acc, self.emit_cond(a)).result
            return acc
        if type(c) in _CMPF:
            return self._cmp(_CMPF[type(c)], _CMPI[type(c)], self.emit(c.lhs), self.emit(c.rhs))
        raise NotImplementedError(f"cannot lower condition {c}")

    def _keep_nan(self, e, acc):
        """A comparison with NaN is false, so a select on it would drop the NaN
        (maximum(NaN, 1) = 1): where an operand of a condition is NaN, the result is
        their sum, which is NaN, as in NumPy."""
        pairs = [(r.lhs, r.rhs) for _, c in e.args for r in sympy.preorder_traversal(c)
                 if type(r) in _CMPF]
        if not pairs:
            return acc
        nan = total = None
        for lhs, rhs in pairs:
            a, b = self.emit(lhs), self.emit(rhs)
            uno = arith.CmpFOp(ir.IntegerAttr.get(ir.IntegerType.get_signless(64), _CMPF_UNO), a, b).result
            s = self._add(a, b)
            nan = uno if nan is None else arith.OrIOp(nan, uno).result
            total = s if total is None else self._add(total, s)
        return arith.SelectOp(nan, total, acc).result

    def _cmp(self, fpred, ipred, a, b):
        if self.is_float:
            pred = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), _CMPF_CODE[fpred])
            return arith.CmpFOp(pred, a, b).result
        pred = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), _CMPI_CODE[ipred])
        return arith.CmpIOp(pred, a, b).result

    def _add(self, a, b):
        return arith.AddFOp(a, b).result if self.is_float else arith.AddIOp(a, b).result

    def _sub(self, a, b):
        return arith.SubFOp(a, b).result if self.is_float else arith.SubIOp(a, b).result

    def _mul(self, a, b):
        return arith.MulFOp(a, b).result if self.is_float else arith.MulIOp(a, b).result

    def _neg(self, a):
        return arith.NegFOp(a).result if self.is_float else arith.SubIOp(self.const(0), a).result

    def _pow(self, base, exp):
        if base == 2 and not exp.is_number:
            return math.Exp2Op(self.emit(exp)).result
        if exp == sympy.Rational(1, 2):
            return math.SqrtOp(self.emit(base)).result
        if exp == sympy.Rational(-1, 2):
            return math.RsqrtOp(self.emit(base)).result
        if exp.is_Integer:
            n = int(exp)
            x = self.emit(base)
            if n == 0:
                return self.const(1)
            acc = None
            sq, k = x, abs(n)
            while k:   # square-and-multiply
                if k & 1:
                    acc = sq if acc is None else self._mul(acc, sq)
                k >>= 1
                if k:
                    sq = self._mul(sq, sq)
            return acc if n > 0 else arith.DivFOp(self.const(1.0), acc).result
        return math.PowFOp(self.emit(base), self.emit(exp)).result
