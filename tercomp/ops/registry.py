"""The op registry: every tern op is declared once, with all its rules.

An OpDef carries the op's operands and attributes, its shape/dtype rule (`infer`), its
NumPy reference (`reference`, which is also the interpreter), its VJP rule (`vjp`,
written with tern ops through a GraphBuilder so that backward graphs are ordinary IR),
and either an MLIR lowering (`lower`) or a decomposition into other tern ops
(`decompose`, for composites such as softmax). Family files (`elementwise.py`,
`reduce.py`, `linalg.py`, `shape.py`, `composite.py`, `ternary.py`) fill the registry.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from ..errors import TraceError, TypeSpecError, ConfigError
from ..ir import Graph, SourceLoc, UNKNOWN_LOC, Value, numpy_dtype
from ..ir import parser as _parser
from ..ir import verifier as _verifier


@dataclass
class OpDef:
    name: str
    family: str
    infer: Callable[[list, dict], list]           # operand types, attrs -> result types
    reference: Callable[[list, dict], list]        # numpy arrays, attrs -> numpy arrays
    num_operands: Optional[int] = 1                # None: variadic
    num_results: Optional[int] = 1                 # None: variadic
    attrs: dict = field(default_factory=dict)      # name -> default (REQUIRED if none)
    lower: Optional[Callable] = None               # (LowerCtx, op, mlir operands) -> mlir values
    decompose: Optional[Callable] = None           # (GraphBuilder, operands, attrs) -> values
    vjp: Optional[Callable] = None                 # (GraphBuilder, op, cotangents) -> operand cotangents,
                                                   # or None: differentiate the decomposition
    differentiable: bool = True                    # False: integer/boolean results, no gradient
    nondiff_operands: tuple = ()                   # operand indices that never get gradients
    expr: Any = None                               # sympy expression (elementwise family)
    region_args: Optional[Callable] = None         # operand types, attrs -> [(body attr, input types)]
    foldable: bool = True                          # False: simplify never evaluates it on constants
    method: Optional[str] = None                   # the traced tensors' method of it (x.sum()), if any
    doc: str = ""


REQUIRED = object()
REGISTRY: dict[str, OpDef] = {}


def register(opdef: OpDef) -> OpDef:
    if opdef.name in REGISTRY:
        raise ConfigError(f"op {opdef.name!r} registered twice",
                          hint="define each op once, in its family file in tercomp/ops/")
    REGISTRY[opdef.name] = opdef
    return opdef


def get(name: str) -> OpDef:
    try:
        return REGISTRY[name]
    except KeyError:
        raise TraceError(f"unknown op 'tern.{name}'",
                         hint=f"known ops: {', '.join(sorted(REGISTRY))}") from None


def normalize_attrs(opdef: OpDef, attrs: dict) -> dict:
    out = {}
    for k, v in attrs.items():
        if k not in opdef.attrs:
            raise TraceError(f"tern.{opdef.name} has no attribute {k!r}",
                             hint=f"its attributes are {sorted(opdef.attrs) or 'none'}")
        out[k] = v
    for k, default in opdef.attrs.items():
        if k not in out:
            if default is REQUIRED:
                raise TraceError(f"tern.{opdef.name} needs the attribute {k!r}")
            if default is not None:
                out[k] = default
    return out


def infer_types(opname: str, types: list, attrs: dict) -> list:
    opdef = get(opname)
    if opdef.num_operands is not None and len(types) != opdef.num_operands:
        raise TraceError(f"tern.{opname} takes {opdef.num_operands} operands, got {len(types)}")
    return opdef.infer(types, normalize_attrs(opdef, attrs))


def region_args(opname: str, types: list, attrs: dict) -> list:
    """[(attribute name, input types)] of the body regions of op `opname` (for the parser)."""
    opdef = get(opname)
    if opdef.region_args is None:
        raise TraceError(f"tern.{opname} has no body region")
    return opdef.region_args(types, attrs)


#: the registry's rules for the IR layer (tercomp.ir.parser.OpRules)
RULES = _parser.OpRules(infer_types, region_args)


def parse(text: str, filename: str = "<string>"):
    """Parse tern IR text into a Graph, every op checked by the registry's shape rules."""
    return _parser.parse(text, filename, RULES)


def verify(graph, stage: str = "") -> None:
    """The IR verifier (tercomp.ir.verifier) with the registry's shape rules."""
    _verifier.verify(graph, stage, RULES)


class GraphBuilder:
    """Emits registered ops into a Graph. Used by the tracer, VJP rules, decompositions
    and rewrite passes alike: `b.emit("mul", x, y)` or `b.mul(x, y)`."""

    def __init__(self, graph: Graph, loc: SourceLoc = UNKNOWN_LOC):
        self.graph = graph
        self.loc = loc

    def emit(self, opname: str, *operands: Value, name: str | None = None,
             names: list | None = None, **attrs):
        """Emit one op; returns its single result, or a tuple when it has several."""
        opdef = get(opname)
        try:
            attrs = normalize_attrs(opdef, attrs)
            types = infer_types(opname, [v.type for v in operands], attrs)
        except (TraceError, TypeSpecError) as e:    # a shape rule's; the op's line is known here
            if e.loc is None and self.loc is not UNKNOWN_LOC:
                raise type(e)(e.message, loc=self.loc, hint=e.hint) from None
            raise
        if names is None:
            names = [name or opname] * len(types)
        op = self.graph.add_op(opname, operands, attrs, types, self.loc, names=names)
        return op.results[0] if len(op.results) == 1 else tuple(op.results)

    def constant(self, value, name: str = "cst"):
        """A constant from a NumPy array (its dtype is kept)."""
        return self.emit("constant", name=name, value=np.asarray(value))

    def scalar(self, value, dtype: str):
        """A rank-0 constant of `dtype` ('f32', ...); broadcasts in elementwise ops."""
        return self.constant(np.asarray(value, dtype=numpy_dtype(dtype)))

    def __getattr__(self, opname):
        if opname.startswith("_") or opname not in REGISTRY:
            raise AttributeError(opname)
        return lambda *args, **kw: self.emit(opname, *args, **kw)
