"""One rewrite driver for pattern tables (simplify, ternary, ...).

`rewrite(graph, patterns)` walks the ops in order and copies them into a new Graph.
For each op, `patterns[opname]` (a list of functions `(b, op, operands) -> Value | None`,
where `b` is a GraphBuilder positioned on the new graph at the op's location and
`operands` are the already-rewritten operands) may return a replacement value for the
op's single result. Value names are kept.
"""
from __future__ import annotations

from ..ir import Graph
from ..ops import GraphBuilder


def copy_op(b: GraphBuilder, op, operands):
    new = b.graph.add_op(op.opname, operands, op.attrs, [r.type for r in op.results], op.loc,
                         names=[r.name for r in op.results])
    return new.results


def rewrite(graph: Graph, patterns: dict, on_op=None) -> Graph:
    new = Graph(name=graph.name, meta=dict(graph.meta))
    repl = {}
    for v in graph.inputs:
        nv = new.add_input(v.name, v.type)
        repl[v] = nv
    b = GraphBuilder(new)
    for op in graph.ops:
        operands = [repl[v] for v in op.operands]
        b.loc = op.loc
        out = None
        for pat in list(patterns.get(op.opname, ())) + list(patterns.get("*", ())):
            out = pat(b, op, operands)
            if out is not None:
                break
        if out is None and on_op is not None:
            out = on_op(b, op, operands)
        if out is None:
            results = copy_op(b, op, operands)
        else:
            results = out if isinstance(out, (list, tuple)) else [out]
        for r, nr in zip(op.results, results):
            repl[r] = nr
    new.set_outputs([repl[v] for v in graph.outputs], graph.output_names)
    return new


def dce(graph: Graph) -> Graph:
    """Drop ops whose results are not needed by the outputs."""
    live = set(id(v) for v in graph.outputs)
    keep = []
    for op in reversed(graph.ops):
        if any(id(r) in live for r in op.results):
            keep.append(op)
            live.update(id(v) for v in op.operands)
    graph.ops = keep[::-1]
    return graph
