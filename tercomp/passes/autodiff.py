"""autodiff: symbolic reverse mode over tern IR.

`backward` walks a region of ops in reverse and asks each op's registry entry for its
VJP, written in tern ops, so the backward graph is ordinary IR: it is simplified,
lowered and compiled like any other code, and can be differentiated again.
Composite ops without a VJP rule are differentiated through their decomposition.
Backward values are named after their primals (`%fc1.weight.grad`).

The `autodiff` pass turns a traced loss function (output 0 a scalar) into the joint
forward + backward graph whose outputs are the gradients (and, optionally, the value
and auxiliary outputs).
"""
from __future__ import annotations

from ..errors import TercompError
from ..ir import Graph, Value
from ..ir.types import is_float
from ..ops import GraphBuilder, get
from .manager import register_pass


def zeros_like(b: GraphBuilder, v: Value) -> Value:
    z = b.scalar(0.0, v.dtype)
    if v.type.rank == 0:
        return z
    return b.emit("broadcast_to", z, shape=[d if isinstance(d, int) else str(d) for d in v.shape])


def _propagates(op, active) -> bool:
    """Whether gradients flow from an active operand of `op` to its results. Not through
    operands the op declares non-differentiable (`size`'s, `stop_gradient`'s), so ops
    downstream of them need no gradient rule and get no backward code."""
    opdef = get(op.opname)
    if not opdef.differentiable:
        return False
    return any(id(v) in active for i, v in enumerate(op.operands) if i not in opdef.nondiff_operands)


def backward(b: GraphBuilder, ops: list, seeds: dict, wrt: list) -> list:
    """Cotangents of `wrt` given `seeds` {output Value: cotangent Value}, through `ops`
    (in topological order). Returns one Value (or None if unreachable) per `wrt`."""
    graph = b.graph
    start = len(graph.ops)
    active = {id(v) for v in wrt}
    region = []
    for op in ops:
        if _propagates(op, active):
            region.append(op)
            for r in op.results:
                if is_float(r.dtype):
                    active.add(id(r))
    ct: dict = {}
    for v, g in seeds.items():
        if id(v) in active:
            ct[id(v)] = g
    finalized = []
    for op in reversed(region):
        cts = [ct.get(id(r)) for r in op.results]
        if all(c is None for c in cts):
            continue
        for r, c in zip(op.results, cts):
            if c is not None:
                finalized.append((c, r.name))
        opdef = get(op.opname)
        b.loc = op.loc
        cts = [c if c is not None else zeros_like(b, r) for r, c in zip(op.results, cts)]
        if opdef.vjp is not None:
            grads = opdef.vjp(b, op, cts)
        elif opdef.decompose is not None:
            sub_start = len(graph.ops)
            outs = opdef.decompose(b, list(op.operands), op.attrs)
            outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
            grads = backward(b, graph.ops[sub_start:], dict(zip(outs, cts)), list(op.operands))
        else:
            raise TercompError(f"tern.{op.opname} has no gradient rule", loc=op.loc,
                               hint="wrap the computation in tc.stop_gradient(...) or define a "
                                    "rule with tc.custom_vjp")
        for i, (v, g) in enumerate(zip(op.operands, grads)):
            if g is None or id(v) not in active or i in opdef.nondiff_operands:
                continue
            if g.type.shape != v.type.shape and g.type != v.type:
                raise TercompError(f"internal: the VJP of tern.{op.opname} gave operand {i} a cotangent of "
                                   f"type {g.type}, expected {v.type}", loc=op.loc)
            ct[id(v)] = g if id(v) not in ct else b.add(ct[id(v)], g)
    results = [ct.get(id(v)) for v in wrt]
    _name_cotangents(graph, start, [(g, v.name) for g, v in zip(results, wrt) if g is not None] + finalized)
    return results


def _name_cotangents(graph: Graph, start: int, pairs):
    created = {id(r) for op in graph.ops[start:] for r in op.results}
    done = set()
    for g, primal in pairs:
        if id(g) in created and id(g) not in done:
            g.name = graph.fresh_name(f"{primal}.grad")
            done.add(id(g))


def saved_for_backward(fwd_ops, bwd_ops) -> list:
    """The values a backward reads from its forward (activations, stacked scan residuals),
    constants aside: [[name, shape with symbolic dims as text, dtype]], JSON-able so a
    compiled module can report them (CompiledModule.memory_report)."""
    made = {id(r) for op in fwd_ops if op.opname != "constant" for r in op.results}
    out, seen = [], set()
    for op in bwd_ops:
        for v in op.operands:
            if id(v) in made and id(v) not in seen:
                seen.add(id(v))
                out.append([v.name, [d if isinstance(d, int) else str(d) for d in v.shape], v.dtype])
    return out


def seed_for(b: GraphBuilder, out: Value, what: str, loc=None) -> Value:
    if out.type.rank != 0:
        raise TercompError(f"{what} needs a scalar output, but the function returns "
                           f"%{out.name} of shape {out.type}", loc=loc,
                           hint="reduce it first (tc.sum / tc.mean), or use tc.vjp with a cotangent")
    if not is_float(out.dtype):
        raise TercompError(f"{what}: the output %{out.name} is {out.dtype}, not floating point", loc=loc)
    return b.scalar(1.0, out.dtype)


def check_differentiable(values, what, loc=None):
    for v in values:
        if not is_float(v.dtype):
            raise TercompError(f"{what}: input %{v.name} is {v.dtype}; only floating-point inputs "
                               "can be differentiated", loc=loc,
                               hint="leave integer inputs (labels, ids) out of argnums")


@register_pass("autodiff")
def autodiff(graph: Graph, wrt: list | None = None, return_value: bool = False, has_aux: bool = False) -> Graph:
    """Append the backward of output 0 with respect to the inputs at indices `wrt`.

    Outputs become [value?, aux?, *grads] following the flags."""
    if wrt is None:
        wrt = [i for i, v in enumerate(graph.inputs) if is_float(v.dtype)]
    out = graph.outputs[0]
    loc = out.producer.loc if out.producer is not None else None
    wrt_values = [graph.inputs[i] for i in wrt]
    check_differentiable(wrt_values, "grad", loc)
    b = GraphBuilder(graph, loc) if loc is not None else GraphBuilder(graph)
    seed = seed_for(b, out, "grad", loc)
    grads = backward(b, list(graph.ops), {out: seed}, wrt_values)
    grads = [g if g is not None else zeros_like(b, v) for g, v in zip(grads, wrt_values)]
    outs, names = [], []
    if return_value:
        outs.append(out)
        names.append(graph.output_names[0])
    if has_aux:
        outs += graph.outputs[1:]
        names += graph.output_names[1:]
    outs += grads
    names += [f"{v.name}.grad" for v in wrt_values]
    graph.set_outputs(outs, names)
    return graph
