"""Print a Graph as MLIR generic syntax in the `tern` dialect, inside `func.func`.

    %3 = "tern.matmul"(%x, %fc1.weight) {transpose_b = true}
           : (tensor<?x784xf32>, tensor<256x784xf32>) -> tensor<?x256xf32> loc("mlp.py":14:12)

Symbolic dims print as `?`; their names are kept on the function's arguments
(`{tern.dims = ["B", 784 : i64]}`) and the parser recomputes every other shape from them.
Constants larger than ELIDE_LIMIT elements print as `dense_resource<__elided__>` unless
`elide=False`.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from .types import TensorType, is_static

if TYPE_CHECKING:       # graph.py imports this module to print itself
    from .graph import Graph, Op

ELIDE_LIMIT = 16


def fmt_float(f: float) -> str:
    f = float(f)
    if not math.isfinite(f):
        return "0x" + np.array(f, dtype=np.float64).view(np.uint64).item().to_bytes(8, "big").hex().upper()
    s = repr(f)
    if "e" in s:
        mant, exp = s.split("e")
        if "." not in mant:
            mant += ".0"
        return f"{mant}e{exp}"
    return s if "." in s else s + ".0"


def fmt_dense(value: np.ndarray, type: TensorType, elide: bool) -> str:
    if not isinstance(value, np.ndarray) and not np.isscalar(value):
        return "dense_resource<__elided__>"
    value = np.asarray(value)
    if (value.size > ELIDE_LIMIT and elide):
        return "dense_resource<__elided__>"
    flat = value.reshape(-1)
    if type.dtype == "i1":
        if value.size and (flat == flat[0]).all():
            return f"dense<{'true' if flat[0] else 'false'}>"
        return "dense<" + _nested(value, lambda b: "true" if b else "false") + ">"
    if value.size and (flat == flat[0]).all() and (value.dtype.kind != "f" or np.isfinite(flat[0])):
        v = flat[0]
        return f"dense<{fmt_float(v) if value.dtype.kind == 'f' else int(v)}>"
    data = np.ascontiguousarray(value.astype(value.dtype.newbyteorder("<")))
    return f'dense<"0x{data.tobytes().hex().upper()}">'


def _nested(a: np.ndarray, fmt) -> str:
    if a.ndim == 0:
        return fmt(a.item())
    return "[" + ", ".join(_nested(x, fmt) for x in a) + "]"


def fmt_attr(v) -> str:
    if isinstance(v, (bool, np.bool_)):
        return "true" if v else "false"
    if isinstance(v, (int, np.integer)):
        return f"{int(v)} : i64"
    if isinstance(v, (float, np.floating)):
        return f"{fmt_float(v)} : f64"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(fmt_attr(x) for x in v) + "]"
    raise TypeError(f"cannot print attribute value {v!r}")


def fmt_loc(loc) -> str:
    return f'loc("{loc.file}":{loc.line}:{loc.col})'


def print_region(body: Graph, elide: bool, indent: str, locations: bool = True) -> str:
    """A body as an MLIR region: one block whose arguments are the body's inputs, ended
    by `"tern.yield"` of its outputs. Block arguments carry no attributes in MLIR, so
    symbolic dims print as `?` and the parser takes them from the op's operands."""
    args = ", ".join(f"%{v.name}: {v.type.mlir()}" for v in body.inputs)
    lines = ["{", f"{indent}^bb0({args}):" if args else f"{indent}^bb0:"]
    for op in body.ops:
        lines.append(indent + "  " + print_op(op, elide, indent + "  ", locations))
    vals = ", ".join("%" + v.name for v in body.outputs)
    types = ", ".join(v.type.mlir() for v in body.outputs)
    lines.append(f'{indent}  "tern.yield"({vals}) : ({types}) -> ()')
    lines.append(indent + "}")
    return "\n".join(lines)


def print_op(op: Op, elide: bool = True, indent: str = "  ", locations: bool = True) -> str:
    outs = ", ".join("%" + r.name for r in op.results)
    ins = ", ".join("%" + v.name for v in op.operands)
    attrs = []
    bodies = op.region_attrs()
    for k in sorted(op.attrs):
        v = op.attrs[k]
        if k in bodies:
            continue
        if k == "value":
            t = op.results[0].type
            attrs.append(f"value = {fmt_dense(v, t, elide)} : {t.mlir()}")
        else:
            attrs.append(f"{k} = {fmt_attr(v)}")
    attr_s = " {" + ", ".join(attrs) + "}" if attrs else ""
    in_t = ", ".join(v.type.mlir() for v in op.operands)
    out_t = ", ".join(r.type.mlir() for r in op.results)
    if len(op.results) != 1:
        out_t = f"({out_t})"
    lhs = f"{outs} = " if op.results else ""
    regions = ""
    if bodies:
        regions = " (" + ", ".join(print_region(op.attrs[k], elide, indent, locations)
                                   for k in bodies) + ")"
    loc = f" {fmt_loc(op.loc)}" if locations else ""
    return f'{lhs}"tern.{op.opname}"({ins}){regions}{attr_s} : ({in_t}) -> {out_t}{loc}'


def print_graph(g: Graph, elide: bool = True, locations: bool = True) -> str:
    """The text of `g`; `locations=False` leaves out the source locations (`loc(...)`)."""
    args = []
    for v in g.inputs:
        a = f"%{v.name}: {v.type.mlir()}"
        if not v.type.is_static:
            dims = ", ".join(f"{d} : i64" if is_static(d) else f'"{d}"' for d in v.type.shape)
            a += f" {{tern.dims = [{dims}]}}"
        args.append(a)
    res_t = ", ".join(v.type.mlir() for v in g.outputs)
    names = ", ".join(f'"{n}"' for n in g.output_names)
    lines = [f"func.func @{g.name}({', '.join(args)}) -> ({res_t}) attributes {{tern.output_names = [{names}]}} {{"]
    for op in g.ops:
        lines.append("  " + print_op(op, elide, "  ", locations))
    rets = ", ".join("%" + v.name for v in g.outputs)
    lines.append(f'  "func.return"({rets}) : ({res_t}) -> ()')
    lines.append("}")
    return "\n".join(lines) + "\n"
