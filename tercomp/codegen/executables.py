"""Hand-written dispatches: a `stream.executable` given as MLIR text (vector code over
memref bindings, compiled by IREE like any dispatch; rendered from a kernel template,
kernels/template.py) is added once to the module being built, and `dispatch` calls one
of its exports with `flow.dispatch` at the current insertion point."""
from __future__ import annotations

from typing import Sequence

from iree.compiler import ir
from iree.compiler.dialects import flow


def _module_body(block: ir.Block) -> ir.Block:
    op = block.owner
    while op.name != "builtin.module":
        op = op.parent
    return op.regions[0].blocks[0]


def ensure_executable(name: str, text) -> None:
    """Add `stream.executable @name` (text, or a callable returning it) to the enclosing
    module unless one of that name is there already."""
    body = _module_body(ir.InsertionPoint.current.block)
    for op in body.operations:
        if "sym_name" in op.attributes and ir.StringAttr(op.attributes["sym_name"]).value == name:
            return
    exe = ir.Operation.parse(text() if callable(text) else text)
    ir.InsertionPoint(body.operations[0]).insert(exe)      # the body holds the function


def dispatch(executable: str, entry: str, workload: Sequence[ir.Value], args: Sequence[ir.Value],
             arg_dims: Sequence[ir.Value], result_type,
             result_dims: Sequence[ir.Value]):
    """`flow.dispatch @executable::@entry[workload](args)`; `arg_dims` are the dynamic
    sizes of the tensor arguments in order, `result_dims` those of the results. A list
    of result types gives a list of results."""
    types = list(result_type) if isinstance(result_type, (list, tuple)) else [result_type]
    op = flow.DispatchOp(types, list(workload),
                         ir.ArrayAttr.get([ir.SymbolRefAttr.get([executable, entry])]),
                         list(args), list(arg_dims), list(result_dims))
    return list(op.results) if isinstance(result_type, (list, tuple)) else op.result


def dispatch_in_place(executable: str, entry: str, workload: Sequence[ir.Value],
                      args: Sequence[ir.Value], arg_dims: Sequence[ir.Value]) -> ir.Value:
    """`flow.dispatch` whose one result is its first argument updated in place (a tied
    operand: `-> %args[0]`, which must be statically shaped): the executable gets a
    binding per argument and none for the result, and writes the result through the
    first argument's binding; IREE keeps the tensor's storage (a KV cache's global) with
    no copy."""
    op = flow.DispatchOp([args[0].type], list(workload),
                         ir.ArrayAttr.get([ir.SymbolRefAttr.get([executable, entry])]),
                         list(args), list(arg_dims), [])
    # IREE stores tied operands as index attributes (its verifier's message says i64)
    op.operation.attributes["tied_operands"] = ir.ArrayAttr.get(
        [ir.IntegerAttr.get(ir.IndexType.get(), 0)])
    return op.result


def split_rows(n: int, workgroups: int, align: int) -> tuple[int, int]:
    """(rows per workgroup, workgroup count): about `workgroups` workgroups over n rows,
    each a multiple of `align` rows."""
    per = -(-n // workgroups)
    rows = max(align, -(-per // align) * align)
    return rows, -(-n // rows)
