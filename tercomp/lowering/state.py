"""Modules with state: several entry points over mutable `util.global`s.

A stateful entry point is a pure tern Graph some of whose inputs and outputs are bound
to named state variables. Each graph is lowered as a private function (`@<graph.name>`)
and wrapped in a public one (`@<entry name>`) that loads the bound inputs from their
globals, calls it, stores the bound outputs back and returns the rest:

    util.global private mutable @k0 = dense<0.0> : tensor<2048x4x64xf16>
    func.func private @decode_step(%ids, %start, %k0) -> (tensor<1x32000xf32>, tensor<2048x4x64xf16>)
    func.func @decode(%ids: tensor<1xi32>, %start: tensor<i32>) -> tensor<1x32000xf32> {
      %k = util.global.load @k0
      %logits, %k1 = func.call @decode_step(%ids, %start, %k)
      util.global.store %k1, @k0
      return %logits
    }

An entry may take some of its 0-d integer inputs as plain scalars (`Entry.scalars`: an
`i32` argument, made a 0-d tensor inside with `tensor.from_elements`). A 0-d tensor
argument is a device buffer, and a value the host needs (a cache row's offset, a
dispatch's push constant) is then read back through the queue before the command buffer
is recorded: a copy, a fence and a wait on every call (measured at the 700M decode step:
0.27-0.37 ms of a 7.5 ms call, bench/RESULTS.md 2026-11-28 13:00).

IREE inlines the call; a state output computed by `tensor.insert_slice` into the loaded
global is then updated in place (measured with IREE 3.13: 12 us for a row of a 16 MiB
global). A state variable must not be returned as an ordinary output as well: IREE
would copy the whole global out on every call.

All entry points of one module share the globals, and the weights they read as
parameters (codegen.params: one `util.global` per array, however many functions load it).

The globals are private to the module, so each entry point records the ones it reads
or writes in its reflection (`iree.reflection = {tercomp.state = "k0: tensor<2048x4x64xf16>,
..."}`, which iree.runtime returns as `VmFunction.reflection`): a loader can check a
saved module's metadata (an LM's max_seq) against the module itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from iree.compiler import ir
from iree.compiler.dialects import func, tensor, util

from ..errors import CompileError
from ..ir import Graph, TensorType, is_static
from ..codegen.builders import tensor_type
from .driver import Lowered, check_legal, lower_graph, lowered


@dataclass
class StateVar:
    """A mutable global of a static type; its contents before the first write are unspecified."""
    name: str
    type: TensorType

    def __post_init__(self):
        if not all(is_static(d) for d in self.type.shape):
            raise CompileError(f"state {self.name!r} needs a static shape, got {self.type}")


@dataclass
class Entry:
    """Public function `name` running `graph`; `inputs` / `outputs` map a graph input /
    output index to the state variable it is bound to; `scalars` are the indices of
    0-d integer inputs the function takes as scalars (see the module doc)."""
    name: str
    graph: Graph
    inputs: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    scalars: frozenset = frozenset()


def _check(entry: Entry, state: dict, others):
    g = entry.graph
    if g.name == entry.name:
        raise CompileError(f"entry {entry.name!r}: the graph needs another name than the entry")
    if any(e.graph.name == g.name and e.graph is not g for e in others):
        raise CompileError(f"entry {entry.name!r}: another entry has a different graph named {g.name!r}")
    for i in entry.scalars:
        t = g.inputs[i].type if 0 <= i < len(g.inputs) else None
        if t is None or i in entry.inputs or t.rank != 0 or t.dtype not in ("i32", "i64"):
            raise CompileError(f"entry {entry.name!r}: input {i} taken as a scalar must be an "
                               f"unbound 0-d i32 or i64 input, got {t}")
    for where, binding, values in (("input", entry.inputs, g.inputs), ("output", entry.outputs, g.outputs)):
        for i, name in binding.items():
            if name not in state:
                raise CompileError(f"entry {entry.name!r}: {where} {i} is bound to an unknown state {name!r}")
            if not 0 <= i < len(values) or values[i].type != state[name].type:
                got = values[i].type if 0 <= i < len(values) else "nothing"
                raise CompileError(f"entry {entry.name!r}: {where} {i} ({got}) does not have the "
                                   f"type of state {name!r} ({state[name].type})")


def _splat(t: TensorType, value: int) -> ir.Attribute:
    mt = tensor_type(t)
    et = mt.element_type
    v = ir.FloatAttr.get(et, float(value)) if isinstance(et, (ir.F16Type, ir.F32Type, ir.F64Type)) \
        else ir.IntegerAttr.get(et, value)
    return ir.DenseElementsAttr.get_splat(mt, v)


def to_stateful_mlir(entries, state, ctx: ir.Context, params=None,
                     targets=("llvm-cpu",)) -> Lowered:
    """One MLIR module with a mutable global per StateVar of `state` and a public
    function per Entry of `entries` (see the module doc), compiled for `targets`, with
    the IREE flags its kernels need (lowering.Lowered). `params`: the ParamTable of
    the weights (codegen.params), shared by every entry."""
    state = {s.name: s for s in state}
    for e in entries:
        _check(e, state, entries)
    with ctx, ir.Location.unknown():
        module = ir.Module.create()
        with ir.InsertionPoint(module.body):
            # Each global starts as a different splat (its index), not all as zeros:
            # IREE 3.13 dedupes equal initial values into one resource, its
            # iree-util-fuse-globals then merges globals initialized from it into ONE
            # global, and two KV caches silently share storage. Only rows written
            # by an entry are ever read, so the initial contents do not matter.
            for i, s in enumerate(state.values()):
                util.GlobalOp(s.name, tensor_type(s.type), sym_visibility="private",
                              is_mutable=True, initial_value=_splat(s.type, i))
        done, kernels = set(), set()     # entries may share a graph: lower it once
        for e in entries:
            if id(e.graph) not in done:
                kernels |= lower_graph(e.graph, module, params, targets)
                inner = module.body.operations[len(module.body.operations) - 1]
                inner.attributes["sym_visibility"] = ir.StringAttr.get("private")
                done.add(id(e.graph))
            _entry(module, e, state)
        check_legal(module)
    return lowered(module, kernels, targets)


def state_reflection(names, state: dict) -> str:
    """The `tercomp.state` reflection string of state variables `names`."""
    return ", ".join(f"{n}: {tensor_type(state[n].type)}" for n in names)


def _scalar_type(t: TensorType) -> ir.Type:
    return ir.IntegerType.get_signless(int(t.dtype[1:]))


def _entry(module: ir.Module, e: Entry, state: dict):
    g = e.graph
    args = [tensor_type(v.type) if i not in e.scalars else _scalar_type(v.type)
            for i, v in enumerate(g.inputs) if i not in e.inputs]
    results = [tensor_type(v.type) for i, v in enumerate(g.outputs) if i not in e.outputs]
    bound = set(e.inputs.values()) | set(e.outputs.values())
    with ir.InsertionPoint(module.body):
        fop = func.FuncOp(e.name, (args, results))
        fop.attributes["iree.reflection"] = ir.DictAttr.get({"tercomp.state": ir.StringAttr.get(
            state_reflection([n for n in state if n in bound], state))})
        block = fop.add_entry_block()
    with ir.InsertionPoint(block):
        given = iter(block.arguments)
        operands = [util.GlobalLoadOp(tensor_type(v.type), e.inputs[i]).result if i in e.inputs
                    else tensor.FromElementsOp(tensor_type(v.type), [next(given)]).result
                    if i in e.scalars else next(given) for i, v in enumerate(g.inputs)]
        call = func.CallOp([tensor_type(v.type) for v in g.outputs], g.name, operands)
        out = []
        for i, r in enumerate(call.results):
            if i in e.outputs:
                util.GlobalStoreOp(r, e.outputs[i])
            else:
                out.append(r)
        func.ReturnOp(out)
