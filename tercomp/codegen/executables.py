"""Hand-written dispatches: a `stream.executable` given as MLIR text (vector code over
memref bindings, compiled by IREE like any dispatch) is added once to the module being
built, and `dispatch` calls one of its exports with `flow.dispatch` at the current
insertion point. The kernels are `ternary_avx2` (the ternary decode GEMV) and
`dense_avx2` (the narrow-weight output layer)."""
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


def split_rows(n: int, workgroups: int, align: int) -> tuple[int, int]:
    """(rows per workgroup, workgroup count): about `workgroups` workgroups over n rows,
    each a multiple of `align` rows."""
    per = -(-n // workgroups)
    rows = max(align, -(-per // align) * align)
    return rows, -(-n // rows)


def load_row(dst: str, i: int, base: str, col: str, mem: str, mem_type: str, vec_type: str,
             ahead: int, prefetch: bool = True, locality: int = 0,
             offset: int | None = None) -> list[str]:
    """MLIR lines loading `vec_type` from row `base` + `offset` (default i) of `mem` at
    column `col` into %{dst}{i}, and (with `prefetch`) prefetching the same column
    `ahead` rows further on (past the last row that address is in no row: x86 prefetches
    never fault), with `locality` 0 (prefetchnta) to 3 (prefetcht0)."""
    lines = [
        f"%row{dst}{i} = affine.apply affine_map<(d0) -> (d0 + {i if offset is None else offset})>({base})",
        f"%{dst}{i} = vector.load {mem}[%row{dst}{i}, {col}] : {mem_type}, {vec_type}",
    ]
    if prefetch:
        lines += [
            f"%pre{dst}{i} = affine.apply affine_map<(d0) -> (d0 + {ahead})>(%row{dst}{i})",
            f"memref.prefetch {mem}[%pre{dst}{i}, {col}], read, locality<{locality}>, data : "
            f"{mem_type}",
        ]
    return lines


def executable_text(name: str, groups, params: str, body: str,
                    per_group: int | None = None) -> str:
    """`stream.executable @name` with one export `@name` over `groups` workgroups (along
    x; None: ceil(m / per_group) of them; (few, many, m_min): `many` when m >= m_min, else
    `few`) whose function takes `params` (stream bindings and scalars, the last
    `%m: index`, the workload) and runs `body` (the statements before `return`)."""
    if isinstance(groups, tuple):
        few, many, m_min = groups
        count = (f"%few = arith.constant {few} : index\n    "
                 f"%many = arith.constant {many} : index\n    "
                 f"%mmin = arith.constant {m_min} : index\n    "
                 f"%big = arith.cmpi uge, %m, %mmin : index\n    "
                 f"%g = arith.select %big, %many, %few : index")
    elif groups is not None:
        count = f"%g = arith.constant {groups} : index"
    else:
        count = f"%g = affine.apply affine_map<()[s0] -> (s0 ceildiv {per_group})>()[%m]"
    return f"""
stream.executable private @{name} {{
  stream.executable.export public @{name} workgroups(%m: index) -> (index, index, index) {{
    %c1 = arith.constant 1 : index
    {count}
    stream.return %g, %c1, %c1 : index, index, index
  }}
  builtin.module {{
    func.func @{name}({params}) {{
{body}
      return
    }}
  }}
}}
"""
