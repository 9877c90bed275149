"""Small MLIR-emission helpers shared by the op lowerings (linalg on tensors).

LowerCtx is what every op's `lower` rule receives: it maps tern Values to MLIR values,
turns tern types into MLIR types, materializes symbolic dims as `index` values (from
`tensor.dim` of the function arguments that carry them), builds the common
`linalg.generic` / `tensor.empty` / `linalg.fill` shapes, holds the ParamTable
that large constants are read from as parameters (`ctx.params`, see codegen.params),
and collects the kernel table's rows the lowering emits (`ctx.kernels`), whose IREE
flags the module needs.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import sympy
from iree.compiler import ir
from iree.compiler.dialects import arith, linalg, tensor

from ..ir import TensorType, is_static
from ..dtypes import mlir_element
from ..errors import CompileError
from ..sympy_walk import Backend, SympyWalker

PARALLEL = "parallel"
REDUCTION = "reduction"


def elem_type(dtype: str) -> ir.Type:
    name = mlir_element(dtype)
    return {"f64": ir.F64Type.get, "f32": ir.F32Type.get, "f16": ir.F16Type.get}.get(
        name, lambda: ir.IntegerType.get_signless(int(name[1:])))()


def tensor_type(t: TensorType) -> ir.RankedTensorType:
    dyn = ir.ShapedType.get_dynamic_size()
    return ir.RankedTensorType.get([d if is_static(d) else dyn for d in t.shape], elem_type(t.dtype))


def scalar_const(value, dtype: str) -> ir.Value:
    et = elem_type(dtype)
    if dtype.startswith("f"):
        return arith.ConstantOp(et, ir.FloatAttr.get(et, float(value))).result
    if dtype == "i1":
        return arith.ConstantOp(et, ir.IntegerAttr.get(et, 1 if value else 0)).result
    return arith.ConstantOp(et, ir.IntegerAttr.get(et, int(value))).result


def const(value, type_: ir.Type) -> ir.Value:
    """arith.constant `value` of the MLIR type `type_` (a scalar or vector type)."""
    return arith.constant(type_, value)


def index_const(v: int) -> ir.Value:
    return arith.ConstantOp(ir.IndexType.get(), v).result


def value_dim(x: ir.Value, axis: int) -> ir.Value:
    """The size of `x`'s dim `axis` as an `index` value (`tensor.dim` when dynamic)."""
    t = ir.RankedTensorType(x.type)
    if not t.is_dynamic_dim(axis):
        return index_const(t.get_dim_size(axis))
    return tensor.DimOp(x, index_const(axis)).result


def scalar_index(t: ir.Value) -> ir.Value:
    """The integer rank-0 tensor `t` (an i32 position) as an `index` value."""
    v = tensor.ExtractOp(t, []).result
    return arith.IndexCastOp(ir.IndexType.get(), v).result


def iterator_attr(kinds: Sequence[str]) -> ir.ArrayAttr:
    return ir.ArrayAttr.get([ir.Attribute.parse(f"#linalg.iterator_type<{k}>") for k in kinds])


def maps_attr(maps: Sequence[ir.AffineMap]) -> ir.ArrayAttr:
    return ir.ArrayAttr.get([ir.AffineMapAttr.get(m) for m in maps])


def affine_map(n_dims: int, exprs: Sequence) -> ir.AffineMap:
    """exprs: ints k -> dim k; ('c', v) -> the constant v."""
    out = []
    for e in exprs:
        if isinstance(e, tuple):
            out.append(ir.AffineConstantExpr.get(e[1]))
        else:
            out.append(ir.AffineDimExpr.get(e))
    return ir.AffineMap.get(n_dims, 0, out)


def generic(result_type: ir.Type, ins: Sequence[ir.Value], out: ir.Value,
            maps: Sequence[ir.AffineMap], iterators: Sequence[str], body: Callable) -> ir.Value:
    """One-result linalg.generic over `ins` into `out` (`iterators`: PARALLEL /
    REDUCTION) whose body is `body(*scalar args, out's scalar) -> the yielded value`."""
    op = linalg.GenericOp([result_type], list(ins), [out], maps_attr(maps),
                          iterator_attr(iterators))
    elem_types = [ir.RankedTensorType(v.type).element_type for v in (*ins, out)]
    block = op.regions[0].blocks.append(*elem_types)
    with ir.InsertionPoint(block):
        linalg.YieldOp([body(*block.arguments)])
    return op.results[0]


_DIM_HINT = ("a compiled dimension must be a sum or product of the inputs' symbolic "
             "dims, or one divided by an integer (B + 1, 2*T, B*T/2); give that input "
             "such a size, or a static one")


class _DimBackend(Backend):
    """A symbolic dim as `index` arithmetic: a symbol is `tensor.dim` of the function
    argument that carries it (`symbol_sources`: Symbol -> (ir.Value, axis)), a quotient
    an unsigned division."""

    negates = False

    def __init__(self, symbol_sources: dict):
        self.symbol_sources = symbol_sources

    def number(self, n):
        if not n.is_Integer:
            raise CompileError(f"a tensor dimension comes out as the non-integer {n}",
                               hint=_DIM_HINT)
        return index_const(int(n))

    def symbol(self, s):
        src, axis = self.symbol_sources[s]
        return tensor.DimOp(src, index_const(axis)).result

    def add(self, a, b):
        return arith.AddIOp(a, b).result

    def mul(self, a, b):
        return arith.MulIOp(a, b).result

    def div(self, a, b):
        return arith.DivUIOp(a, b).result

    def multiplies(self, n):
        return False        # a power of a dim is not materialized (Unsupported)

    def fraction(self, e):
        num, den = sympy.fraction(e)
        return list(sympy.Mul.make_args(num)), ([] if den == 1 else [den])

    def unsupported(self, e):
        return CompileError(f"cannot compute the dimension {e} at run time", hint=_DIM_HINT)


class LowerCtx:
    """State of the tern -> MLIR lowering of one function."""

    def __init__(self, symbol_sources: dict, params=None, targets=("llvm-cpu",)):
        self.values: dict = {}          # tern Value -> ir.Value
        self.symbol_sources = symbol_sources  # sympy Symbol -> (ir.Value, axis)
        self.params = params            # codegen.params.ParamTable, or None (all inline)
        # the tercomp target names the module is compiled for: a lowering whose usual
        # form does not fit a target's limits picks another form by them
        self.targets = tuple(targets)
        self._dim_cache: dict = {}
        # The kernel table's rows the lowered ops were emitted with (shared with op
        # bodies): the lowering driver reports their IREE flags with the module.
        self.kernels: set = set()

    def child(self) -> "LowerCtx":
        """A context for an op body (a loop's): the body's values and the dims it
        materializes stay inside it (a dim made inside a loop does not dominate the code
        after the loop). An op's lowering does not lower its body's ops itself: it yields
        (child context, ops) to the lowering driver, which lowers them at the current
        insertion point and resumes it (tercomp/lowering/driver.py)."""
        sub = LowerCtx(self.symbol_sources, self.params, self.targets)
        sub._dim_cache = dict(self._dim_cache)
        sub.kernels = self.kernels
        return sub

    # -- dims ------------------------------------------------------------------------
    def dim(self, d) -> ir.Value:
        """An `index` value for a static or symbolic dim."""
        if is_static(d):
            return index_const(d)
        key = sympy.srepr(d)
        if key not in self._dim_cache:
            self._dim_cache[key] = SympyWalker(_DimBackend(self.symbol_sources), memo=False).emit(d)
        return self._dim_cache[key]

    def dyn_sizes(self, t: TensorType) -> list:
        return [self.dim(d) for d in t.shape if not is_static(d)]

    # -- tensors ---------------------------------------------------------------------
    def empty(self, t: TensorType) -> ir.Value:
        sizes = [d if is_static(d) else self.dim(d) for d in t.shape]
        return tensor.EmptyOp(sizes, elem_type(t.dtype)).result

    def fill(self, t: TensorType, value) -> ir.Value:
        init = self.empty(t)
        return linalg.fill(scalar_const(value, t.dtype), outs=[init])

    def generic(self, inputs: Sequence[ir.Value], input_maps: Sequence[ir.AffineMap],
                out_type: TensorType, out_map: ir.AffineMap, iterators: Sequence[str],
                body: Callable, init: ir.Value | None = None, in_elem=None) -> ir.Value:
        """One linalg.generic with a single output. `body(*scalar_args, acc)` returns the
        yielded scalar; `init` defaults to tensor.empty (for all-parallel generics)."""
        if init is None:
            init = self.empty(out_type)
        return generic(tensor_type(out_type), inputs, init, [*input_maps, out_map], iterators,
                       body)

    def elementwise(self, operands: Sequence[ir.Value], operand_types: Sequence[TensorType],
                    out_type: TensorType, body: Callable) -> ir.Value:
        """A parallel generic with NumPy broadcasting of every operand to out_type."""
        r = out_type.rank
        maps = [broadcast_map(t, out_type) for t in operand_types]
        ident = ir.AffineMap.get_identity(r)
        return self.generic(operands, maps, out_type, ident, [PARALLEL] * r,
                            lambda *args: body(*args[:-1]))


def broadcast_map(t: TensorType, out: TensorType) -> ir.AffineMap:
    """NumPy broadcasting as an affine map: right-aligned, size-1 dims read index 0."""
    r, k = out.rank, t.rank
    exprs = []
    for i, d in enumerate(t.shape):
        od = out.shape[r - k + i]
        exprs.append(("c", 0) if (d == 1 and od != 1) else r - k + i)
    return affine_map(r, exprs)


def dense_attr(value: np.ndarray, t: TensorType) -> ir.Attribute:
    """A dense elements attribute built from the NumPy buffer (fast for big constants)."""
    arr = np.ascontiguousarray(value)
    return ir.DenseElementsAttr.get(arr, type=tensor_type(t))
