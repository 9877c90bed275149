"""Constants and gradient control: constant, stop_gradient."""
from __future__ import annotations

import numpy as np
from iree.compiler import ir
from iree.compiler.dialects import arith

from ..codegen.builders import dense_attr, tensor_type
from ..codegen.params import Parameter
from ..errors import CompileError, InputError
from ..ir import TensorType
from ..ir.types import dtype_name
from .registry import OpDef, REQUIRED, register


def _constant_infer(types, a):
    v = a["value"]
    return [TensorType(tuple(v.shape), dtype_name(v.dtype))]


def _constant_reference(xs, a):
    v = a["value"]
    if hasattr(v, "array") and isinstance(v.array, np.ndarray):   # a codegen.params.Parameter
        return [v.array]
    if not isinstance(v, np.ndarray):
        raise InputError("this constant's data was elided from the IR text, so it cannot be evaluated",
                         hint="print or dump the IR with elide=False to keep constants")
    return [v]


def _constant_lower(ctx, op, operands):
    t = op.results[0].type
    v = op.attrs["value"]
    if isinstance(v, Parameter):            # read from the .irpa archive, not embedded
        if ctx.params is None:
            raise CompileError(f"constant %{op.results[0].name} is a parameter, but the "
                               "lowering has no parameter table", loc=op.loc)
        return [ctx.params.load(v, tensor_type(t))]
    if not isinstance(v, np.ndarray):
        raise CompileError(f"constant %{op.results[0].name} has elided data and cannot be compiled",
                           loc=op.loc, hint="parse IR printed with elide=False")
    if t.dtype == "i1" and v.size > 1 and not (v.all() or not v.any()):
        return [_bool_from_i8(ctx, v, t)]
    return [arith.ConstantOp(tensor_type(t), dense_attr(v, t)).result]


def _bool_from_i8(ctx, v, t):
    """A non-splat bool constant as i8 bytes narrowed by one elementwise op. IREE 3.13
    miscompiles i1 constants read inside a data-tiled dispatch ("load_from_buffer ...
    element types must match"); i8 storage is what it would use for them anyway."""
    t8 = TensorType(t.shape, "i8")
    c = arith.ConstantOp(tensor_type(t8), dense_attr(v.astype(np.int8), t8)).result
    return ctx.elementwise([c], [t8], t,
                           lambda x: arith.TruncIOp(ir.IntegerType.get_signless(1), x).result)


register(OpDef("constant", "control", _constant_infer, _constant_reference, num_operands=0,
               attrs={"value": REQUIRED}, lower=_constant_lower, differentiable=False,
               foldable=False))


# the identity whose operand takes no gradient: autodiff stops at it like at any
# non-differentiable operand, and simplify keeps it (foldable=False) so the IR shows it
register(OpDef("stop_gradient", "control", lambda ts, a: [ts[0]], lambda xs, a: [xs[0]],
               lower=lambda ctx, op, xs: [xs[0]], vjp=lambda b, op, cts: [None],
               nondiff_operands=(0,), foldable=False, doc="identity whose gradient is zero"))


# its VJP calls the user's bwd on traced values, so tercomp.autodiff, which has the tracer,
# installs it (as it does the VJPs of tern.scan and tern.checkpoint)
register(OpDef(
    "custom_vjp", "control",
    lambda ts, a: list(ts[:a["n_outputs"]]),
    lambda xs, a: list(xs[:a["n_outputs"]]),
    num_operands=None, num_results=None,
    attrs={"rule": REQUIRED, "n_outputs": REQUIRED, "n_inputs": REQUIRED, "res_tree": "null"},
    lower=lambda ctx, op, xs: list(xs[:op.attrs["n_outputs"]]),
    doc="identity on its first n_outputs operands (the forward's results); its VJP calls the "
        "user's bwd on the residual operands (tc.custom_vjp)"))
