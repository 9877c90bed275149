"""Values, ops and graphs: the data structure of tern IR.

A Graph is one function: named inputs, ops in topological order, named outputs. Every
Value has a name derived from the user's code and every Op the source location of the
user line that made it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from .printer import print_graph
from .types import TensorType


@dataclass(frozen=True)
class SourceLoc:
    file: str
    line: int
    col: int = 0

    def __str__(self):
        return f"{self.file}:{self.line}"


UNKNOWN_LOC = SourceLoc("<unknown>", 0, 0)


class Value:
    """An SSA value: a name, a type, and the op that produced it (None for inputs).
    `grad_of` names the primal when autodiff made this value its gradient."""

    __slots__ = ("name", "type", "producer", "index", "grad_of")

    def __init__(self, name: str, type: TensorType, producer: Optional["Op"] = None, index: int = 0):
        self.name = name
        self.type = type
        self.producer = producer
        self.index = index
        self.grad_of: str | None = None

    @property
    def shape(self):
        return self.type.shape

    @property
    def dtype(self):
        return self.type.dtype

    def __repr__(self):
        return f"%{self.name}: {self.type}"


class Op:
    """One operation: `opname` is the registry name without the `tern.` prefix."""

    __slots__ = ("opname", "operands", "attrs", "results", "loc")

    def __init__(self, opname: str, operands: list, attrs: dict, results: list, loc: SourceLoc):
        self.opname = opname
        self.operands = list(operands)
        self.attrs = dict(attrs)
        self.results = list(results)
        self.loc = loc

    def region_attrs(self) -> list:
        """The names of the Graph-valued attributes (body regions), in name order."""
        return [k for k in sorted(self.attrs) if isinstance(self.attrs[k], Graph)]

    def __repr__(self):
        ins = ", ".join("%" + v.name for v in self.operands)
        outs = ", ".join("%" + v.name for v in self.results)
        return f"{outs} = tern.{self.opname}({ins}) {self.attrs}"


_NAME_OK = re.compile(r"[^A-Za-z0-9_.$\-]")


def sanitize_name(name: str) -> str:
    name = _NAME_OK.sub("_", name) or "v"
    if name[0].isdigit():
        name = "v" + name
    return name


def regions(op: Op) -> list:
    """The nested graphs (body regions) of `op`, in attribute-name order: a loop such as
    tern.scan keeps its body as a Graph-valued attribute."""
    return [op.attrs[k] for k in op.region_attrs()]


@dataclass
class Graph:
    """A function in tern IR."""

    name: str = "forward"
    inputs: list = field(default_factory=list)
    ops: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    output_names: list = field(default_factory=list)
    meta: dict = field(default_factory=dict, repr=False)  # pytree structure of args/results
    _names: dict = field(default_factory=dict, repr=False)

    def fresh_name(self, base: str) -> str:
        """A unique value name from `base`: 'x', then 'x_1', 'x_2', ..."""
        base = sanitize_name(base)
        n = self._names.get(base)
        if n is None:
            self._names[base] = 0
            return base
        while True:
            n += 1
            cand = f"{base}_{n}"
            if cand not in self._names:
                self._names[base] = n
                self._names[cand] = 0
                return cand

    def reserve(self, name: str):
        self._names.setdefault(name, 0)

    def add_input(self, name: str, type: TensorType) -> Value:
        v = Value(self.fresh_name(name), type)
        self.inputs.append(v)
        return v

    def add_op(self, opname: str, operands, attrs: dict, result_types, loc: SourceLoc,
               names=None) -> Op:
        op = Op(opname, operands, attrs, [], loc)
        for body in regions(op):
            if body._names is not self._names:   # a body's names stay unique in the function
                for n in body.all_names():
                    self.reserve(n)
        names = names or [opname] * len(result_types)
        op.results = [Value(self.fresh_name(n), t, op, i)
                      for i, (n, t) in enumerate(zip(names, result_types))]
        self.ops.append(op)
        return op

    def all_names(self):
        """Every value name defined here, in nested bodies too."""
        for v in self.inputs:
            yield v.name
        for op in self.ops:
            for r in op.results:
                yield r.name
            for body in regions(op):
                yield from body.all_names()

    def set_outputs(self, values, names=None):
        self.outputs = list(values)
        self.output_names = list(names) if names else [f"out{i}" for i in range(len(values))]

    def users(self) -> dict:
        """Value -> list of ops that use it."""
        out: dict = {}
        for op in self.ops:
            for v in op.operands:
                out.setdefault(v, []).append(op)
        return out

    def __str__(self):
        return print_graph(self)

    def structurally_equal(self, other: "Graph") -> bool:
        """Same text, constants included (names, types, attrs, locations)."""
        return print_graph(self, elide=False) == print_graph(other, elide=False)
