"""Elementwise ops, each defined by one sympy expression.

From the expression come the NumPy reference (sympy.lambdify), the derivative
(sympy.diff, simplified, emitted as tern ops) and the MLIR lowering (the body of a
linalg.generic, emitted by codegen.sympy_mlir). Binary ops broadcast as NumPy does.

Expressions are chosen so that both they and their derivatives are numerically stable:
sigmoid is (tanh(x/2) + 1) / 2 (its derivative (1 - tanh(x/2)^2) / 4 never forms
inf/inf), relu and maximum are Piecewise (their derivatives are exact 0/1 selects; ties
of maximum send the gradient to the first operand).
"""
from __future__ import annotations

import functools

import numpy as np
import sympy
from iree.compiler import ir
from iree.compiler.dialects import arith, flow, util

from ..codegen.builders import elem_type, scalar_const
from ..codegen.sympy_mlir import ArithBackend
from ..errors import TraceError
from ..ir import TensorType, numpy_dtype
from ..ir.types import is_float
from ..sympy_walk import FUNCTIONS, SympyWalker
from .registry import OpDef, REQUIRED, register
from .shape import unbroadcast
from .sympy_tern import TernBackend

X, Y = sympy.symbols("x y", real=True)
P = sympy.Symbol("p", real=True)


def broadcast_shapes(*shapes):
    """NumPy broadcasting of static or symbolic shapes; TraceError names all shapes."""
    rank = max(len(s) for s in shapes)
    out = []
    for i in range(rank):
        dims = [s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0]
        non1 = [d for d in dims if d != 1]
        d = non1[0] if non1 else 1
        for e in non1[1:]:
            if e != d:
                shown = " and ".join("[" + ", ".join(str(x) for x in s) + "]" for s in shapes)
                raise TraceError(f"shapes {shown} cannot be broadcast together (dim {i}: {d} vs {e})",
                                 hint="reshape or expand_dims one operand so the trailing dims agree")
        out.append(d)
    return tuple(out)


def _same_dtype(types, opname):
    dts = {t.dtype for t in types}
    if len(dts) > 1:
        raise TraceError(f"{opname}: operands have different dtypes {sorted(dts)}",
                         hint="cast one operand with tc.cast(x, dtype) (or x.astype(dtype))")
    return types[0].dtype


def _symbols(n):
    return (X, Y)[:n]


@functools.lru_cache(maxsize=None)
def _derivative(expr, sym, subs_key):
    e = expr.subs(dict(subs_key)) if subs_key else expr
    d = sympy.diff(e, sym)
    if d.count_ops() >= 40:
        return d
    # keep the simplified form only if it stays within the functions the sympy walker
    # emits as tern ops (simplify likes to turn 1 - tanh(x)**2 into cosh(x)**-2)
    s = sympy.simplify(d)
    ok = all(f.func in FUNCTIONS or isinstance(f, sympy.Piecewise) for f in s.atoms(sympy.Function))
    return s if ok and s.count_ops() <= d.count_ops() else d


@functools.lru_cache(maxsize=None)
def _numpy_function(syms, expr):
    """The NumPy function of an expression (the reference), made once per expression:
    sympy.lambdify takes ~40 ms a call, and its first call in a process ~0.25 s (it
    imports sympy's code printers), which simplify's constant folding would pay in every
    compile. The four arithmetic operators are NumPy's ufuncs, which is what lambdify
    writes for them."""
    arith = {X + Y: np.add, X - Y: np.subtract, X * Y: np.multiply, X / Y: np.true_divide,
             -X: np.negative}
    if syms == _symbols(len(syms)) and expr in arith:
        return arith[expr]
    return sympy.lambdify(syms, expr, modules="numpy")


def _bound(expr, attrs):
    if "exponent" in attrs:
        return expr.subs(P, sympy.nsimplify(attrs["exponent"]))
    return expr


def elementwise(name, expr, arity, *, attrs=None, result_dtype=None, differentiable=True,
                float_only=False, method=False, doc=""):
    """Register the elementwise op `name` defined by the sympy `expr` of X (and Y); with
    method=True traced tensors have it as a method too (x.exp())."""
    syms = _symbols(arity)

    def infer(types, a):
        dt = _same_dtype(types, name)
        if float_only and not is_float(dt):
            raise TraceError(f"{name} needs a floating-point operand, got {dt}",
                             hint="cast the operand to float32 first")
        return [TensorType(broadcast_shapes(*[t.shape for t in types]), result_dtype or dt)]

    def reference(xs, a):
        e = _bound(expr, a)
        dt = xs[0].dtype
        f = _numpy_function(syms, e)
        with np.errstate(all="ignore"):
            out = f(*xs)
            if dt.kind == "f" and e.has(sympy.Piecewise):     # NaN in, NaN out (the lowering too)
                out = np.where(np.isnan(sum(xs)), np.asarray(sum(xs)), out)
        shape = np.broadcast_shapes(*[x.shape for x in xs])
        odt = numpy_dtype(result_dtype) if result_dtype else dt
        return [np.broadcast_to(np.asarray(out), shape).astype(odt)]

    def lower(ctx, op, operands):
        e = _bound(expr, op.attrs)
        types = [v.type for v in op.operands]
        dt = types[0].dtype

        def body(*args):
            return SympyWalker(ArithBackend(dict(zip(syms, args)), dt)).emit(e)
        return [ctx.elementwise(operands, types, op.results[0].type, body)]

    def vjp(b, op, cts):
        g = cts[0]
        key = tuple(sorted(((P, sympy.nsimplify(op.attrs["exponent"])),))) if "exponent" in op.attrs else ()
        out = []
        em = SympyWalker(TernBackend(b, dict(zip(syms, op.operands)), op.operands[0].dtype))
        for v, s in zip(op.operands, syms):
            d = _derivative(expr, s, key)
            if d == 0:
                out.append(None)
                continue
            if d == -1:
                # negated after the sum over broadcast axes, not before: IREE 3.13 folds a
                # neg into the reduction below it (acc - x), which its CUDA backend rejects
                # ("failed to get neutral element for reduction"); and it is fewer negations
                out.append(b.neg(unbroadcast(b, g, v.type)))
                continue
            contrib = g if d == 1 else b.mul(g, em.emit(d))
            out.append(unbroadcast(b, contrib, v.type))
        return out

    return register(OpDef(name, "elementwise", infer, reference, num_operands=arity,
                          attrs=attrs or {}, lower=lower, vjp=vjp if differentiable else None,
                          differentiable=differentiable, expr=expr, method=name if method else None,
                          doc=doc))


# -- unary -----------------------------------------------------------------------------
elementwise("neg", -X, 1)
elementwise("exp", sympy.exp(X), 1, float_only=True, method=True)
elementwise("log", sympy.log(X), 1, float_only=True, method=True)
elementwise("sqrt", sympy.sqrt(X), 1, float_only=True, method=True)
elementwise("rsqrt", 1 / sympy.sqrt(X), 1, float_only=True)
elementwise("tanh", sympy.tanh(X), 1, float_only=True, method=True)
elementwise("sin", sympy.sin(X), 1, float_only=True)
elementwise("cos", sympy.cos(X), 1, float_only=True)
elementwise("exp2", 2 ** X, 1, float_only=True, doc="2 ** x")
elementwise("log2", sympy.log(X) / sympy.log(2), 1, float_only=True, doc="log(x) / log(2)")
elementwise("sigmoid", (sympy.tanh(X / 2) + 1) / 2, 1, float_only=True)
elementwise("relu", sympy.Piecewise((X, X > 0), (0, True)), 1)
elementwise("silu", X * (sympy.tanh(X / 2) + 1) / 2, 1, float_only=True)
elementwise("gelu", X * (1 + sympy.tanh(sympy.sqrt(2 / sympy.pi) * (X + sympy.Float("0.044715") * X ** 3))) / 2,
            1, float_only=True, doc="GELU, tanh approximation")
elementwise("abs", sympy.Abs(X), 1)
elementwise("sign", sympy.sign(X), 1, differentiable=False)
elementwise("pow", X ** P, 1, attrs={"exponent": REQUIRED}, float_only=True,
            doc="x ** exponent for a scalar exponent")

# -- binary ----------------------------------------------------------------------------
elementwise("add", X + Y, 2)
elementwise("sub", X - Y, 2)
elementwise("mul", X * Y, 2)
elementwise("div", X / Y, 2, float_only=True)
elementwise("maximum", sympy.Piecewise((X, X >= Y), (Y, True)), 2)
elementwise("minimum", sympy.Piecewise((X, X <= Y), (Y, True)), 2)

# -- comparisons (boolean results, no gradient) ----------------------------------------
for _name, _rel in [("lt", X < Y), ("le", X <= Y), ("gt", X > Y), ("ge", X >= Y),
                    ("eq", sympy.Eq(X, Y)), ("ne", sympy.Ne(X, Y))]:
    elementwise(_name, _rel, 2, result_dtype="i1", differentiable=False)


# -- where and cast: elementwise but not sympy-defined ---------------------------------
def _where_infer(types, a):
    c, x, y = types
    if c.dtype != "i1":
        raise TraceError(f"where: the condition must be boolean, got {c.dtype}",
                         hint="compare with tc.greater(...) etc. to get a boolean")
    dt = _same_dtype([x, y], "where")
    return [TensorType(broadcast_shapes(c.shape, x.shape, y.shape), dt)]


def _where_lower(ctx, op, operands):
    return [ctx.elementwise(operands, [v.type for v in op.operands], op.results[0].type,
                            lambda c, x, y: arith.SelectOp(c, x, y).result)]


def _where_vjp(b, op, cts):
    c, x, y = op.operands
    g = cts[0]
    zero = b.scalar(0.0, g.dtype)
    return [None, unbroadcast(b, b.where(c, g, zero), x.type), unbroadcast(b, b.where(c, zero, g), y.type)]


register(OpDef("where", "elementwise", _where_infer,
               lambda xs, a: [np.where(xs[0], xs[1], xs[2])], num_operands=3,
               lower=_where_lower, vjp=_where_vjp, nondiff_operands=(0,)))


#: Targets on which a widened float (f16 -> f32) is kept out of its consumers'
#: dispatches. IREE 3.13's SPIR-V codegen for a Vulkan target without 16-bit storage
#: (the default vp_android_baseline_2022, Mali's valhall), given a row reduction whose
#: rows are also read by an elementwise consumer in the same dispatch (an RMSNorm of
#: an f16 embedding row, x - mean(x)) and an extf producing them, keeps 64 whole rows in
#: workgroup memory: 65,792 bytes at 256 columns, over Vulkan's 16,384.
WIDEN_APART = ("vulkan",)


def _cast_lower(ctx, op, operands):
    """arith casts in a linalg.generic. For a float widening on a WIDEN_APART target
    the result goes through `util.optimization_barrier`, so IREE gives the cast a
    dispatch of its own (one more pass over the widened tensor) instead of fusing it
    into a reduction it cannot fit (see WIDEN_APART)."""
    src, dst = op.operands[0].dtype, op.results[0].dtype
    et = elem_type(dst)
    out = ctx.elementwise(operands, [op.operands[0].type], op.results[0].type,
                          functools.partial(_cast_body, src, dst, et))
    if is_float(src) and is_float(dst) and int(dst[1:]) > int(src[1:]) \
            and any(t in WIDEN_APART for t in ctx.targets):
        # the barrier hides the shape; tie_shape gives IREE its dynamic dims back
        out = flow.tensor_tie_shape(util.optimization_barrier([out.type], [out]),
                                    ctx.dyn_sizes(op.results[0].type))
    return [out]


def _cast_body(src, dst, et, x):

    if src == dst:
        return x
    if is_float(src) and is_float(dst):
        wider = int(dst[1:]) > int(src[1:])
        return (arith.ExtFOp if wider else arith.TruncFOp)(et, x).result
    if is_float(src):
        if dst == "i1":
            return arith.CmpFOp(ir_pred(13), x, scalar_const(0.0, src)).result
        return arith.FPToSIOp(et, x).result
    if is_float(dst):
        return (arith.UIToFPOp if src == "i1" else arith.SIToFPOp)(et, x).result
    sw, dw = int(src[1:]), int(dst[1:])
    if dw > sw:
        return (arith.ExtUIOp if src == "i1" else arith.ExtSIOp)(et, x).result
    return arith.TruncIOp(et, x).result


def ir_pred(code):
    return ir.IntegerAttr.get(ir.IntegerType.get_signless(64), code)


def _cast_vjp(b, op, cts):
    src = op.operands[0].dtype
    if not is_float(src):
        return [None]
    return [b.cast(cts[0], dtype=src)]


register(OpDef("cast", "elementwise",
               lambda ts, a: [ts[0].with_dtype(a["dtype"])],
               lambda xs, a: [(xs[0] != 0) if a["dtype"] == "i1" else xs[0].astype(numpy_dtype(a["dtype"]))],
               attrs={"dtype": REQUIRED}, lower=_cast_lower, vjp=_cast_vjp, method="astype"))
