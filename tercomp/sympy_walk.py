"""One walk over a sympy expression, emitting it through a small backend.

Three backends share it: the body of an elementwise op's linalg.generic as arith/math
ops on scalars (`codegen.sympy_mlir`), an elementwise op's derivative as tern ops
(`ops.sympy_tern`, which is what makes grad-of-grad work) and a symbolic dim as `index`
arithmetic (`codegen.builders`). The walker decides how a node is written (a -1
coefficient as a subtraction, negative powers as divisions, small integer powers as
multiplications, a Piecewise as a chain of selects); a backend only emits the operations,
named as the tern ops are:

    number(n) symbol(s) add sub mul div neg(a) pow(x, exponent: float)
    call(name, *args)   exp log tanh sin cos abs sign sqrt rsqrt exp2
    compare(name, a, b) lt le gt ge eq ne
    select(cond, a, b)

    body = SympyWalker(ArithBackend({x: block_arg}, "f32")).emit(sympy.tanh(x / 2) + 1)

This module imports nothing of tercomp: ops and codegen both use it.
"""
from __future__ import annotations

import sympy

FUNCTIONS = {sympy.exp: "exp", sympy.log: "log", sympy.tanh: "tanh", sympy.sin: "sin",
             sympy.cos: "cos", sympy.Abs: "abs", sympy.sign: "sign"}
RELATIONS = {sympy.StrictLessThan: "lt", sympy.LessThan: "le", sympy.StrictGreaterThan: "gt",
             sympy.GreaterThan: "ge", sympy.Equality: "eq", sympy.Unequality: "ne"}
HALF = sympy.Rational(1, 2)


class Unsupported(Exception):
    """Raised by a backend for an operation it has no form for; the walker turns it into
    the backend's own error naming the expression (`Backend.unsupported`)."""


class Backend:
    """The operations a walk emits; every one not overridden is Unsupported."""

    negates = True      # a -1 coefficient becomes neg / sub (index arithmetic keeps it a factor)

    def number(self, n: sympy.Expr):
        raise Unsupported

    def symbol(self, s: sympy.Symbol):
        raise Unsupported

    def add(self, a, b):
        raise Unsupported

    def sub(self, a, b):
        raise Unsupported

    def mul(self, a, b):
        raise Unsupported

    def div(self, a, b):
        raise Unsupported

    def neg(self, a):
        raise Unsupported

    def pow(self, x, exponent: float):
        raise Unsupported

    def call(self, name: str, *args):
        raise Unsupported

    def compare(self, name: str, a, b):
        raise Unsupported

    def select(self, cond, a, b):
        raise Unsupported

    def keep_nan(self, operands: list, acc):
        """The value of a Piecewise, given the (lhs, rhs) values of its comparisons."""
        return acc

    def multiplies(self, n: int) -> bool:
        """Whether x ** n (an integer n) is written as multiplications and a reciprocal
        rather than one pow."""
        return True

    def divides(self, exp: sympy.Number) -> bool:
        """Whether a factor base ** exp (exp < 0) of a product is written as a division
        by base ** -exp."""
        return True

    def fraction(self, e: sympy.Mul) -> tuple[list, list]:
        """The factors of a product to multiply, and those to divide by."""
        num, den = [], []
        for f in e.args:
            if isinstance(f, sympy.Pow) and f.exp.is_Number and f.exp < 0 and self.divides(f.exp):
                den.append(f.base ** (-f.exp))
            else:
                num.append(f)
        return num, den

    def unsupported(self, e) -> Exception:
        return NotImplementedError(f"cannot emit {e} ({e.func})")


class SympyWalker:
    """Emit sympy expressions through `backend`. With `memo`, a subexpression met twice
    is emitted once (the walker is then for one insertion point: one generic body, one
    VJP rule)."""

    def __init__(self, backend: Backend, memo: bool = True):
        self.b = backend
        self.memo: dict | None = {} if memo else None

    def emit(self, e):
        if self.memo is not None and e in self.memo:
            return self.memo[e]
        try:
            v = self._node(e)
        except Unsupported:
            raise self.b.unsupported(e) from None
        if self.memo is not None:
            self.memo[e] = v
        return v

    def _node(self, e):
        b = self.b
        if isinstance(e, sympy.Symbol):
            return b.symbol(e)
        if e.is_number:
            return b.number(e)
        if isinstance(e, sympy.Add):
            return self._add(e)
        if isinstance(e, sympy.Mul):
            return self._mul(e)
        if isinstance(e, sympy.Pow):
            return self._pow(e)
        if e.func in FUNCTIONS:
            return b.call(FUNCTIONS[e.func], self.emit(e.args[0]))
        if type(e) in RELATIONS:
            return self._compare(e)
        if isinstance(e, sympy.Piecewise):
            return self._piecewise(e)
        raise Unsupported

    def _add(self, e):
        b = self.b
        acc = self.emit(e.args[0])
        for t in e.args[1:]:
            c, rest = t.as_coeff_Mul()
            acc = b.sub(acc, self.emit(rest)) if b.negates and c == -1 else b.add(acc, self.emit(t))
        return acc

    def _mul(self, e):
        b = self.b
        c, rest = e.as_coeff_Mul()
        if b.negates and c == -1:
            return b.neg(self.emit(rest))
        num, den = b.fraction(e)
        acc = self.emit(num[0]) if num else b.number(sympy.Integer(1))
        for f in num[1:]:
            acc = b.mul(acc, self.emit(f))
        for f in den:
            acc = b.div(acc, self.emit(f))
        return acc

    def _pow(self, e):
        b = self.b
        base, exp = e.args
        if base.is_number:                  # a ** x = 2 ** (x log2 a)
            x = self.emit(exp)
            if base != 2:
                x = b.mul(x, b.number(sympy.log(base, 2)))
            return b.call("exp2", x)
        if exp == HALF:
            return b.call("sqrt", self.emit(base))
        if exp == -HALF:
            return b.call("rsqrt", self.emit(base))
        if not exp.is_Number:
            raise Unsupported
        x = self.emit(base)
        if exp.is_Integer and b.multiplies(int(exp)):
            return self._power(x, int(exp))
        return b.pow(x, float(exp))

    def _power(self, x, n: int):
        """x ** n by square-and-multiply; a negative n is 1 / x ** -n."""
        b = self.b
        acc, sq, k = None, x, abs(n)
        while k:
            if k & 1:
                acc = sq if acc is None else b.mul(acc, sq)
            k >>= 1
            if k:
                sq = b.mul(sq, sq)
        return acc if n > 0 else b.div(b.number(sympy.Integer(1)), acc)

    def _compare(self, e):
        """A comparison, emitted anew where it is met (not memoized: the derivatives of
        maximum in x and in y each emit their own; simplify's CSE merges them)."""
        if type(e) not in RELATIONS:
            raise Unsupported
        return self.b.compare(RELATIONS[type(e)], self.emit(e.lhs), self.emit(e.rhs))

    def _piecewise(self, e):
        *cases, (last, _) = e.args
        acc = self.emit(last)
        for val, cond in reversed(cases):
            acc = self.b.select(self._compare(cond), self.emit(val), acc)
        compared = [(self.emit(c.lhs), self.emit(c.rhs)) for _, c in e.args if type(c) in RELATIONS]
        return self.b.keep_nan(compared, acc)
