"""Emit a sympy expression as tern ops (used by the elementwise VJP rules).

The derivative of an elementwise op is sympy.diff of its expression; emitting it as
ordinary tern ops (not as an opaque kernel) is what makes grad-of-grad work.
"""
from __future__ import annotations

import sympy

_REL = {sympy.StrictLessThan: "lt", sympy.LessThan: "le", sympy.StrictGreaterThan: "gt",
        sympy.GreaterThan: "ge", sympy.Equality: "eq", sympy.Unequality: "ne"}
_FUNCS = {sympy.exp: "exp", sympy.log: "log", sympy.tanh: "tanh", sympy.Abs: "abs",
          sympy.sign: "sign", sympy.sin: "sin", sympy.cos: "cos"}


class SympyToTern:
    def __init__(self, b, env: dict, dtype: str):
        self.b, self.env, self.dtype = b, env, dtype
        self.cache: dict = {}

    def emit(self, e):
        if e not in self.cache:
            self.cache[e] = self._emit(e)
        return self.cache[e]

    def _emit(self, e):
        b = self.b
        if isinstance(e, sympy.Symbol):
            return self.env[e]
        if e.is_number:
            return b.scalar(float(e), self.dtype)
        if isinstance(e, sympy.Add):
            acc = self.emit(e.args[0])
            for t in e.args[1:]:
                c, rest = t.as_coeff_Mul()
                acc = b.sub(acc, self.emit(rest)) if c == -1 else b.add(acc, self.emit(t))
            return acc
        if isinstance(e, sympy.Mul):
            c, rest = e.as_coeff_Mul()
            if c == -1:
                return b.neg(self.emit(rest))
            num, den = [], []
            for f in e.args:
                if isinstance(f, sympy.Pow) and f.exp.is_Number and f.exp < 0 and f.exp != sympy.Rational(-1, 2):
                    den.append(f.base ** (-f.exp))
                else:
                    num.append(f)
            acc = self.emit(num[0]) if num else b.scalar(1.0, self.dtype)
            for f in num[1:]:
                acc = b.mul(acc, self.emit(f))
            for f in den:
                acc = b.div(acc, self.emit(f))
            return acc
        if isinstance(e, sympy.Pow) and e.base.is_number:       # a ** x = 2 ** (x log2 a)
            x = self.emit(e.exp)
            if e.base != 2:
                x = b.mul(x, b.scalar(float(sympy.log(e.base, 2)), self.dtype))
            return b.exp2(x)
        if isinstance(e, sympy.Pow):
            x = self.emit(e.base)
            if e.exp == sympy.Rational(1, 2):
                return b.sqrt(x)
            if e.exp == sympy.Rational(-1, 2):
                return b.rsqrt(x)
            if e.exp == -1:
                return b.div(b.scalar(1.0, self.dtype), x)
            if e.exp == 2:
                return b.mul(x, x)
            if e.exp.is_Number:
                return b.pow(x, exponent=float(e.exp))
            raise NotImplementedError(f"symbolic exponent in {e}")
        if e.func in _FUNCS:
            return b.emit(_FUNCS[e.func], self.emit(e.args[0]))
        if isinstance(e, (sympy.Max, sympy.Min)):
            name = "maximum" if isinstance(e, sympy.Max) else "minimum"
            acc = self.emit(e.args[0])
            for a in e.args[1:]:
                acc = b.emit(name, acc, self.emit(a))
            return acc
        if isinstance(e, sympy.Piecewise):
            *cases, (last, _) = e.args
            acc = self.emit(last)
            for val, cond in reversed(cases):
                acc = b.where(self.emit_cond(cond), self.emit(val), acc)
            return acc
        raise NotImplementedError(f"cannot emit {e} as tern ops")

    def emit_cond(self, c):
        if type(c) in _REL:
            return self.b.emit(_REL[type(c)], self.emit(c.lhs), self.emit(c.rhs))
        raise NotImplementedError(f"cannot emit condition {c} as tern ops")
