"""Emit a sympy expression as tern ops (used by the elementwise VJP rules).

The derivative of an elementwise op is sympy.diff of its expression; emitting it as
ordinary tern ops (not as an opaque kernel) is what makes grad-of-grad work
(`SympyWalker(TernBackend(b, env, dtype)).emit(derivative)`).
"""
from __future__ import annotations

from ..sympy_walk import HALF, Backend


class TernBackend(Backend):
    """Tern ops built with the GraphBuilder `b`; `env` maps sympy Symbols to tern Values
    of `dtype`. The walker's operation names are tern op names."""

    def __init__(self, b, env: dict, dtype: str):
        self.b, self.env, self.dtype = b, env, dtype

    def number(self, n):
        return self.b.scalar(float(n), self.dtype)

    def symbol(self, s):
        return self.env[s]

    def add(self, a, b):
        return self.b.add(a, b)

    def sub(self, a, b):
        return self.b.sub(a, b)

    def mul(self, a, b):
        return self.b.mul(a, b)

    def div(self, a, b):
        return self.b.div(a, b)

    def neg(self, a):
        return self.b.neg(a)

    def pow(self, x, exponent):
        return self.b.pow(x, exponent=exponent)

    def divides(self, exp):
        return exp != -HALF     # x ** -1/2 stays a factor: one tern.rsqrt

    def multiplies(self, n):
        return n in (-1, 2)     # other integer powers stay one tern.pow (its lowering multiplies)

    def call(self, name, *args):
        return self.b.emit(name, *args)

    def compare(self, name, a, b):
        return self.b.emit(name, a, b)

    def select(self, cond, a, b):
        return self.b.where(cond, a, b)

    def unsupported(self, e):
        return NotImplementedError(f"cannot emit {e} as tern ops")
