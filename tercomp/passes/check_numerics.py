"""check_numerics: make a compiled module report the first op that produced a NaN or an
Inf (and cross_entropy labels out of range), with the user's source line.

Run last (after simplify, which would fold the checks away). Every floating-point value
v (inputs and op results) gets two numbers: the count of NaNs, sum(v != v), and
sum(v - v), which is NaN iff v holds a NaN or an Inf. cross_entropy's labels get a
count of labels outside [0, C). They are concatenated into one extra f32 output,
`__numerics`, and `graph.meta["numerics"]` describes each value (what made it, where,
and which other checked values it was computed from). The runtime
(tercomp.runtime.numerics.report) raises
NumericsError for the first value in program order that *produced* a problem: a NaN
where no operand had one, or an Inf where every operand was finite. An Inf that only
flows on (a -inf attention mask through a where) is not reported; the NaN that
-inf - -inf makes downstream is.

>>> exe = tc.compile(f, x, check_numerics=True)        # or TERCOMP_CHECK_NUMERICS=1
>>> exe(bad_x)
NumericsError: model.py:12:9: tern.log produced a NaN (value %log) ...
"""
from __future__ import annotations

import os

import numpy as np

from ..ir import Graph
from ..ir.types import is_float, is_static
from ..ops import GraphBuilder
from .manager import register_pass

OUTPUT = "__numerics"


def enabled(check_numerics) -> bool:
    """check_numerics=None follows $TERCOMP_CHECK_NUMERICS ("1", "true", "yes")."""
    if check_numerics is None:
        return os.environ.get("TERCOMP_CHECK_NUMERICS", "").lower() in ("1", "true", "yes")
    return bool(check_numerics)


def _as_entry(b: GraphBuilder, v):
    s = b.sum(v, axes=list(range(v.type.rank)), keepdims=False) if v.type.rank else v
    if s.dtype != "f32":
        s = b.cast(s, dtype="f32")
    return b.reshape(s, shape=[1])


def _checks(b: GraphBuilder, v) -> list:
    """[count of NaNs, sum(v - v)] of a float value, as [1] f32 tensors."""
    nans = b.cast(b.ne(v, v), dtype="f32")
    return [_as_entry(b, nans), _as_entry(b, b.sub(v, v, name="finite_check"))]


def _const_flags(value) -> tuple:
    a = np.asarray(value)
    if a.dtype.kind != "f":
        return False, False
    return bool(np.isnan(a).any()), bool((~np.isfinite(a)).any())


@register_pass("check_numerics")
def check_numerics(graph: Graph) -> Graph:
    """Append the `__numerics` output (see the module doc) to `graph`, in place."""
    if OUTPUT in graph.output_names:
        return graph
    b = GraphBuilder(graph)
    entries, described, index, consts = [], [], {}, {}

    def add(value, what, op, loc, operands):
        index[value] = len(described)
        described.append({"what": what, "op": op, "value": value.name, "loc": loc,
                          "operands": operands})

    for v in graph.inputs:
        if is_float(v.dtype):
            entries += _checks(b, v)
            add(v, f"input %{v.name} contains", None, "", [])
    for op in list(graph.ops):
        if op.opname == "constant":
            consts[op.results[0]] = _const_flags(op.attrs["value"])
            continue
        b.loc = op.loc
        ins = [index[x] for x in op.operands if x in index]
        # a non-finite constant operand: what flows from it is not this op's doing
        ins += [("const",) + consts[x] for x in op.operands if x in consts and any(consts[x])]
        if op.opname == "cross_entropy" and is_static(op.operands[0].type.shape[-1]):
            labels, classes = op.operands[1], int(op.operands[0].type.shape[-1])
            below = b.cast(b.lt(labels, b.scalar(0, labels.dtype)), dtype="f32")
            above = b.cast(b.ge(labels, b.scalar(classes, labels.dtype)), dtype="f32")
            entries += [_as_entry(b, b.add(below, above)), _as_entry(b, b.scalar(0.0, "f32"))]
            described.append({"what": f"a label outside [0, {classes}) reached cross_entropy",
                              "op": "labels", "value": labels.name, "loc": str(op.loc), "operands": []})
        for r in op.results:
            if is_float(r.dtype):
                entries += _checks(b, r)
                add(r, f"tern.{op.opname} produced", op.opname, str(op.loc), ins)
    if not entries:
        return graph
    out = b.concatenate(*entries, axis=0)
    graph.set_outputs(list(graph.outputs) + [out], list(graph.output_names) + [OUTPUT])
    graph.meta["numerics"] = described
    return graph
