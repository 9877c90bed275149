"""VJPs of the ops with a body: tern.scan (a reverse scan) and tern.checkpoint (recompute).

They need the reverse walk itself (`ad.backward`) to differentiate a body, so they are
installed into the registry from here, beside it; ops never import autodiff.

scan. The backward of a body step is built once, as a graph G: a copy of the forward
body followed by its reverse walk. Values of the copy that G's backward part reads and
that vary from step to step (they depend on the carry or on x) are residuals: the
forward scan is rewritten to also output them, stacked over the steps, and G reads them
as per-step inputs instead of recomputing them; what depends only on the captured values
is recomputed in G. G then runs as a scan in the opposite direction whose carries are
the carry cotangent and the running sums of the captured values' cotangents, and whose
per-step outputs are the cotangents of x. A body that is a `tern.checkpoint` call has no
residuals but its carry: its backward recomputes the step from the carry and x.
"""
from __future__ import annotations

import numpy as np

from ..ir import Graph, TensorType, Value
from ..ir.types import is_float
from ..ops import GraphBuilder, get
from ..ops.body_ops import scan_length
from ..passes.rewrite import dce
from .ad import backward, zeros_like


def _is_zero(v: Value) -> bool:
    """A cotangent that the reverse walk made as zeros (an unused result)."""
    p = v.producer
    if p is not None and p.opname == "broadcast_to":
        p = p.operands[0].producer
    if p is None or p.opname != "constant":
        return False
    c = p.attrs.get("value")
    return isinstance(c, np.ndarray) and not c.any()


def _copy_ops(graph: Graph, ops, mapping: dict) -> None:
    """Append copies of `ops` to `graph`, reading operands through `mapping` (updated)."""
    for op in ops:
        new = graph.add_op(op.opname, [mapping[v] for v in op.operands], op.attrs,
                           [r.type for r in op.results], op.loc, names=[r.name for r in op.results])
        mapping.update(zip(op.results, new.results))


def _add_seed(b, seeds, v, ct):
    seeds[v] = b.add(seeds[v], ct) if v in seeds else ct


# -- checkpoint ----------------------------------------------------------------------------
def _checkpoint_vjp(b, op, cts):
    body = op.attrs["body"]
    mapping = dict(zip(body.inputs, op.operands))
    start = len(b.graph.ops)
    _copy_ops(b.graph, body.ops, mapping)          # the recomputation
    seeds = {}
    for out, ct in zip(body.outputs, cts):
        if is_float(out.dtype) and not _is_zero(ct):
            _add_seed(b, seeds, mapping[out], ct)
    wrt, seen = [], set()
    for v in op.operands:                          # an operand given twice gets its grad once
        wrt.append(v if id(v) not in seen else None)
        seen.add(id(v))
    grads = backward(b, b.graph.ops[start:], seeds, [v for v in wrt if v is not None])
    it = iter(grads)
    return [next(it) if v is not None else None for v in wrt]


# -- scan ----------------------------------------------------------------------------------
def _scan_vjp(b, op, cts):
    body = op.attrs["body"]
    nc, nx = op.attrs["n_carry"], op.attrs["n_xs"]
    outer = b.graph
    c_in_b, x_in_b, k_in_b = body.inputs[:nc], body.inputs[nc:nc + nx], body.inputs[nc + nx:]
    fc = [i for i in range(nc) if is_float(c_in_b[i].dtype)]
    fk = [i for i, v in enumerate(k_in_b) if is_float(v.dtype)]
    fx = [i for i, v in enumerate(x_in_b) if is_float(v.dtype)]
    ys = [j for j, v in enumerate(body.outputs[nc:]) if is_float(v.dtype) and not _is_zero(cts[nc + j])]

    # G: the body's forward copy, then its backward
    G = Graph(name=f"{outer.name}.scan_bwd", _names=outer._names)
    mapping = {}
    for v in body.inputs:
        mapping[v] = G.add_input(v.name, v.type)
    dc_in = {i: G.add_input(f"{c_in_b[i].name}.ct", c_in_b[i].type) for i in fc}
    dk_acc = {i: G.add_input(f"{k_in_b[i].name}.grad_acc", k_in_b[i].type) for i in fk}
    dy_in = {j: G.add_input(f"{body.outputs[nc + j].name}.ct", body.outputs[nc + j].type) for j in ys}
    _copy_ops(G, body.ops, mapping)
    fwd_end = len(G.ops)
    bb = GraphBuilder(G, op.loc)
    seeds = {}
    for i in fc:
        _add_seed(bb, seeds, mapping[body.outputs[i]], dc_in[i])
    for j in ys:
        _add_seed(bb, seeds, mapping[body.outputs[nc + j]], dy_in[j])
    wrt = [mapping[c_in_b[i]] for i in fc] + [mapping[x_in_b[i]] for i in fx] + [mapping[k_in_b[i]] for i in fk]
    grads = backward(bb, G.ops[:fwd_end], seeds, wrt) if seeds else [None] * len(wrt)
    grads = [g if g is not None else zeros_like(bb, w) for g, w in zip(grads, wrt)]
    g_c, g_x, g_k = grads[:len(fc)], grads[len(fc):len(fc) + len(fx)], grads[len(fc) + len(fx):]
    g_k = [bb.add(dk_acc[i], g) for i, g in zip(fk, g_k)]
    outs = g_c + g_k + g_x
    G.set_outputs(outs, [f"{c_in_b[i].name}.ct" for i in fc] + [f"{k_in_b[i].name}.grad_acc" for i in fk]
                  + [f"{x_in_b[i].name}.ct" for i in fx])

    # residuals: values of the forward copy that vary per step and that the backward reads
    fwd_ops = G.ops[:fwd_end]        # (a scan among them may have gained residual results)
    named = {id(c): v.name for v, c in mapping.items()}      # residuals named after the body's values
    varying = {id(mapping[v]) for v in c_in_b + x_in_b}
    for o in G.ops[:fwd_end]:
        if any(id(v) in varying for v in o.operands):
            varying.update(id(r) for r in o.results)
    saved = {id(mapping[v]) for v in x_in_b}           # x is at hand: the scanned xs
    residuals = []
    for o in G.ops[fwd_end:]:
        for v in o.operands:
            if id(v) in varying and id(v) not in saved:
                saved.add(id(v))
                residuals.append(v)
    for v in G.outputs:
        if id(v) in varying and id(v) not in saved:
            saved.add(id(v))
            residuals.append(v)
    res_in = {id(v): G.add_input(f"{named.get(id(v), v.name)}.saved", v.type) for v in residuals}
    for o in G.ops[fwd_end:]:
        o.operands = [res_in.get(id(v), v) for v in o.operands]
    G.outputs = [res_in.get(id(v), v) for v in G.outputs]
    dce(G)

    # the forward scan also outputs the residuals, stacked: its new body is a copy of
    # G's forward part, whose values the residuals are
    res_results = []
    if residuals:
        F = Graph(name=body.name, meta=dict(body.meta), _names=body._names)
        fmap = {mapping[v]: F.add_input(v.name, v.type) for v in body.inputs}
        _copy_ops(F, fwd_ops, fmap)
        F.set_outputs([fmap[mapping[v]] for v in body.outputs] + [fmap[v] for v in residuals],
                      list(body.output_names) + [f"{named.get(id(v), v.name)}.saved" for v in residuals])
        op.attrs["body"] = F
        length = scan_length(op.attrs)
        for v in residuals:
            r = Value(outer.fresh_name(f"{named.get(id(v), v.name)}.saved"),
                      TensorType((length,) + tuple(v.shape), v.dtype), op, len(op.results))
            op.results.append(r)
            res_results.append(r)

    # the reverse scan: carries (dc, dk sums), xs (dy, residuals, x), captured values
    used = {id(v) for o in G.ops for v in o.operands} | {id(v) for v in G.outputs}
    carries = [(dc_in[i], cts[i]) for i in fc] + [(dk_acc[i], zeros_like(b, op.operands[nc + nx + i])) for i in fk]
    seqs = [(dy_in[j], cts[nc + j]) for j in ys if id(dy_in[j]) in used]
    seqs += [(res_in[id(v)], r) for v, r in zip(residuals, res_results)]
    seqs += [(mapping[x_in_b[i]], op.operands[nc + i]) for i in range(nx) if id(mapping[x_in_b[i]]) in used]
    consts = [(mapping[k_in_b[i]], op.operands[nc + nx + i]) for i in range(len(k_in_b))
              if id(mapping[k_in_b[i]]) in used]
    G.inputs = [g for g, _ in carries + seqs + consts]
    b.loc = op.loc
    res = b.emit("scan", *[o for _, o in carries + seqs + consts], body=G, n_carry=len(carries),
                 n_xs=len(seqs), length=op.attrs["length"], reverse=not op.attrs.get("reverse", False),
                 names=G.output_names)
    res = list(res) if isinstance(res, tuple) else [res]
    d_init, d_k, d_xs = res[:len(fc)], res[len(fc):len(fc) + len(fk)], res[len(fc) + len(fk):]
    grads = [None] * len(op.operands)
    for i, g in zip(fc, d_init):
        grads[i] = g
    for i, g in zip(fx, d_xs):
        grads[nc + i] = g
    for i, g in zip(fk, d_k):
        grads[nc + nx + i] = g
    return grads


get("scan").vjp = _scan_vjp
get("checkpoint").vjp = _checkpoint_vjp
