"""The one sympy walker (tercomp.sympy_walk) that the elementwise lowering, the
elementwise derivatives and the symbolic dims share.

A NumPy backend evaluates what the walker emits; for every elementwise op in the
registry (every pow exponent form: integer, half, negative, fractional), its expression
and its derivative must walk and agree with sympy's own value. The walker is a leaf
module, and an expression no backend can emit is an error that names it.
"""
from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest
import sympy

import tercomp.sympy_walk as walk_mod
from tercomp.ops import REGISTRY
from tercomp.ops.elementwise import P, X, Y, _derivative
from tercomp.sympy_walk import Backend, SympyWalker

CALLS = {"exp": np.exp, "log": np.log, "tanh": np.tanh, "sin": np.sin, "cos": np.cos,
         "abs": np.abs, "sign": np.sign, "sqrt": np.sqrt, "rsqrt": lambda x: 1 / np.sqrt(x),
         "exp2": np.exp2}
COMPARE = {"lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
           "eq": np.equal, "ne": np.not_equal}
EXPONENTS = [2, 3, 5, -1, -2, -3, 0.5, -0.5, 1.5, -1.5, 2.5, 1 / 3]


class NumpyBackend(Backend):
    def __init__(self, env):
        self.env = env
        self.ops = []                   # the operations emitted, in order

    def _op(self, name, value):
        self.ops.append(name)
        return value

    def number(self, n):
        return float(n)

    def symbol(self, s):
        return self.env[s]

    def add(self, a, b):
        return self._op("add", a + b)

    def sub(self, a, b):
        return self._op("sub", a - b)

    def mul(self, a, b):
        return self._op("mul", a * b)

    def div(self, a, b):
        return self._op("div", a / b)

    def neg(self, a):
        return self._op("neg", -a)

    def pow(self, x, exponent):
        return self._op("pow", x ** exponent)

    def call(self, name, *args):
        return self._op(name, CALLS[name](*args))

    def compare(self, name, a, b):
        return self._op(name, COMPARE[name](a, b))

    def select(self, cond, a, b):
        return self._op("where", np.where(cond, a, b))


VALUES = {X: np.array([0.3, 0.7, 1.3, 2.1, 0.9]), Y: np.array([0.5, 0.7, 1.1, 2.5, 0.4])}


def _expressions():
    """pytest params (expression, id=label) for every elementwise op's expression and
    derivative."""
    out = []
    for name, od in sorted(REGISTRY.items()):
        if getattr(od, "expr", None) is None:
            continue
        syms = (X, Y)[:od.num_operands]
        for p in (EXPONENTS if "exponent" in od.attrs else [None]):
            key = () if p is None else ((P, sympy.nsimplify(p)),)
            expr = od.expr.subs(dict(key))
            at = "" if p is None else f" p={p}"
            out.append(pytest.param(expr, id=f"{name}{at}"))
            if od.differentiable:
                out += [pytest.param(_derivative(od.expr, s, key), id=f"d{name}/d{s}{at}") for s in syms]
    return out


@pytest.mark.parametrize("expr", _expressions())
def test_walk_matches_sympy(expr):
    be = NumpyBackend(VALUES)
    got = SympyWalker(be).emit(expr)
    syms = sorted(expr.free_symbols, key=str)
    want = sympy.lambdify(syms, expr, modules="numpy")(*[VALUES[s] for s in syms])
    got, want = np.broadcast_arrays(np.asarray(got), np.asarray(want))
    assert (got.dtype == bool) == (want.dtype == bool), f"{expr}: gave {got}, sympy {want}"
    assert np.allclose(got, want, rtol=1e-12, atol=1e-12), f"{expr}: gave {got}, sympy {want}"


def test_walk_shapes():
    """How nodes are written: a -1 coefficient is a sub/neg, a negative power a division,
    x ** -1/2 an rsqrt, small integer powers square-and-multiply, a repeated
    subexpression once."""
    cases = [(X - Y, ["sub"]), (-X, ["neg"]), (X / Y, ["div"]), (1 / sympy.sqrt(X), ["rsqrt"]),
             (X ** 5, ["mul", "mul", "mul"]), (X ** -2, ["mul", "div"]), (2 ** X, ["exp2"]),
             (3 ** X, ["mul", "exp2"]), (X ** sympy.Rational(3, 2), ["pow"]),
             (X * sympy.tanh(X) + sympy.tanh(X), ["tanh", "mul", "add"]),
             (sympy.Piecewise((X, X > Y), (Y, True)), ["gt", "where"])]
    for expr, ops in cases:
        be = NumpyBackend(VALUES)
        SympyWalker(be).emit(expr)
        assert be.ops == ops, f"{expr}: emitted {be.ops}, expected {ops}"


def test_unsupported_names_the_expression():
    with pytest.raises(NotImplementedError, match=r"cosh\(x\)"):
        SympyWalker(NumpyBackend(VALUES)).emit(sympy.cosh(X) + 1)
    with pytest.raises(NotImplementedError, match=r"x\*\*y"):
        SympyWalker(NumpyBackend(VALUES)).emit(X ** Y)


def test_walker_is_a_leaf_module():
    tree = ast.parse(pathlib.Path(walk_mod.__file__).read_text())
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    for n in imports:
        assert not (isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith("tercomp"))), \
            f"tercomp/sympy_walk.py line {n.lineno} imports from tercomp"
        assert not (isinstance(n, ast.Import) and any(a.name.startswith("tercomp") for a in n.names)), \
            f"tercomp/sympy_walk.py line {n.lineno} imports tercomp"


@pytest.mark.parametrize("dim", ["floor(T/2)", "B**2"])
def test_a_dim_the_lowering_cannot_compute_is_a_compile_error_at_the_users_line(dim):
    """The dims backend's refusal reaches the user as a CompileError at the line that
    compiled, with what to do, not as a bare ValueError."""
    import tercomp as tc
    from tercomp.errors import CompileError
    with pytest.raises(CompileError, match=r"cannot compute the dimension") as e:
        tc.compile(lambda s, x: (tc.exp(x), s * 2), tc.spec(("B", "T", "C")),
                   tc.spec((dim, 3)), cache=False)
    assert "test_sympy_walk.py" in str(e.value.loc)
    assert "divided by an integer" in e.value.hint
