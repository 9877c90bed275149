"""The verifier: run after every pass. Errors name the op, the rule and the location."""
from __future__ import annotations

from ..errors import VerifyError
from .graph import Graph, regions
from .parser import OpRules
from .types import is_static


def _same_type(a, b) -> bool:
    if a.dtype != b.dtype or len(a.shape) != len(b.shape):
        return False
    for x, y in zip(a.shape, b.shape):
        if is_static(x) != is_static(y):
            return False
        if is_static(x) and x != y:
            return False
        if not is_static(x) and (x - y).simplify() != 0:
            return False
    return True


MAX_DEPTH = 8


def verify(graph: Graph, stage: str = "", rules: OpRules | None = None) -> None:
    """Check the graph's structure (names defined once and before use, bodies isolated)
    and, with the op registry's `rules` (tercomp.ops.RULES), each op's result types."""
    _verify(graph, f" after {stage}" if stage else "", set(), 0, rules)


def _verify(graph: Graph, where: str, names: set, depth: int, rules: OpRules | None) -> None:
    """`names` is shared with the enclosing functions: value names are unique across a
    function and its op bodies. A body sees only its own inputs (bodies are isolated)."""
    if depth > MAX_DEPTH:
        raise VerifyError(f"op bodies nested deeper than {MAX_DEPTH}{where}")
    defined = set()
    for v in graph.inputs:
        if v.name in names:
            raise VerifyError(f"input %{v.name} is defined twice{where}")
        names.add(v.name)
        defined.add(id(v))
    infer = rules.infer if rules is not None else None
    for op in graph.ops:
        for i, v in enumerate(op.operands):
            if id(v) not in defined:
                raise VerifyError(f"tern.{op.opname}: operand {i} (%{v.name}) is used before it is "
                                  f"defined (rule: operands dominate their uses){where}", loc=op.loc)
        for body in regions(op):
            try:
                _verify(body, where, names, depth + 1, rules)
            except VerifyError as e:
                raise VerifyError(f"in the body of tern.{op.opname}: {e.message}",
                                  loc=e.loc or op.loc) from None
        if infer is not None:
            try:
                expect = infer(op.opname, [v.type for v in op.operands], op.attrs)
            except Exception as e:
                raise VerifyError(f"tern.{op.opname}: the shape rule rejects the operands "
                                  f"({e}){where}", loc=op.loc) from None
            for r, t in zip(op.results, expect):
                if not _same_type(r.type, t):
                    raise VerifyError(f"tern.{op.opname}: result %{r.name} has type {r.type} but the "
                                      f"shape rule gives {t} (rule: result types){where}", loc=op.loc)
        for r in op.results:
            if r.name in names:
                raise VerifyError(f"tern.{op.opname}: value %{r.name} is defined twice "
                                  f"(rule: unique names){where}", loc=op.loc)
            names.add(r.name)
            defined.add(id(r))
            if r.producer is not op:
                raise VerifyError(f"tern.{op.opname}: result %{r.name} does not point at its op{where}",
                                  loc=op.loc)
    for v in graph.outputs:
        if id(v) not in defined:
            raise VerifyError(f"output %{v.name} is not defined in the function{where}")
    if len(graph.output_names) != len(graph.outputs):
        raise VerifyError(f"{len(graph.outputs)} outputs but {len(graph.output_names)} output names{where}")
