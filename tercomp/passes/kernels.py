"""The `kernels` pass: which kernel each op takes, settled from the ONE kernel table
(kernels/table.py) for the compile's targets, so that the traced IR is the same on
every host and only this pass looks at the host.

A model traces its ops with their generic kernel (`kernel="generic"`: the op's own
lowering, which every target compiles) and a ternary matmul with `strategy="auto"`;
this pass gives each the kernel of the table's first row that fits the targets, the
host's CPU features (for llvm-cpu alone) and the op's shape. An explicit choice in the
IR is kept (it fits its op: the op's shape rule checks it against the table). A ternary
matmul whose kernel reads its weights fastest in other 2-bit codes (the row's `codes`:
the avx2 kernel's w + 1) gets its constant re-coded here.

`ops` limits the pass to some ops (tc.compile settles only the ternary matmuls: its
modules keep the generic norm, RoPE and attention); `strategy` is the ternary matmul's
requested strategy ("auto", or one of the table's, which then wins over "auto" in the
IR).
"""
from __future__ import annotations

import numpy as np

from .. import ternary_pack as tp
from ..errors import UnsupportedError
from ..kernels import table as kt
from ..kernels.ternary.strategies import check_strategy
from ..ir import Graph
from .manager import register_pass
from .rewrite import dce, rewrite
from .simplify import const_value

_T = "ternary_matmul"


def settle_ternary(strategy: str, types, attrs: dict, targets, loc=None) -> kt.KernelRow:
    """The row of a ternary matmul (operand `types`: x [M, K] and the packed [N, KB],
    `attrs`: k, n, act_quant) for `strategy`: the table's choice for "auto", else the named
    row, which must compile for `targets` and fit the op (a TercompError at `loc`)."""
    if strategy != "auto":
        return kt.take(_T, strategy, types, attrs, targets, loc=loc)
    found = kt.choose(_T, types, attrs, targets)
    if found is None:
        raise UnsupportedError(f"no ternary strategy compiles for {', '.join(targets)}", loc=loc)
    return found


def recode(b, packed, codes: str, recoded: dict):
    """(packed i8 Value, attrs) in the 2-bit `codes` (ternary_pack.CODES) that the kernel
    reads fastest (the row's `codes`), with the `codes` attribute when not "signed".
    `packed` is a signed-code array (packed here) or Value; a constant Value is re-coded
    once into a new constant (`recoded`: id of the signed Value -> (new Value, the name
    it should take over)), shared by every kernel that reads it; any other Value stays as
    it is (every kernel reads signed codes)."""
    attrs = {} if codes == "signed" else {"codes": codes}
    if isinstance(packed, np.ndarray):
        data = tp.to_offset_codes(packed) if codes == "offset" else packed
        return b.constant(data.view(np.int8), name="packed"), attrs
    value = const_value(packed)
    if codes == "signed" or value is None:
        return packed, {}
    if id(packed) not in recoded:
        # a name of its own until `take_names`: taking `packed_1` here would rename the
        # signed constant copied next
        new = b.constant(tp.to_offset_codes(value.view(np.uint8)).view(np.int8),
                         name=f"{packed.name}.offset")
        recoded[id(packed)] = (new, packed.name)
    return recoded[id(packed)][0], attrs


def take_names(graph: Graph, recoded) -> Graph:
    """Give each re-coded constant its signed original's name where that one is gone
    (the usual case), so parameter names (`fc1.weight`, `packed`) do not depend on the
    kernel."""
    taken = set(graph.all_names())
    for v, name in recoded.values():
        if name not in taken:
            taken.discard(v.name)
            v.name = name
            taken.add(name)
    return graph


def _settle_ternary(strategy, targets, recoded):
    """A ternary_matmul with strategy "auto" (parsed, built by a model, or left so by
    the ternary pass) gets the kernel for `targets`; an explicit `strategy` wins."""
    def pat(b, op, xs):
        if op.attrs.get("strategy") != "auto":
            return None
        x, p = xs
        chosen = settle_ternary(strategy, [v.type for v in op.operands], op.attrs, targets,
                                op.loc)
        coded = {}
        if op.attrs["act_quant"] and op.attrs.get("codes", "signed") == "signed":
            p, coded = recode(b, p, chosen.codes, recoded)
        return b.ternary_matmul(x, p, **{**op.attrs, "strategy": chosen.kernel, **coded},
                                name=op.results[0].name)
    return pat


def _settle(opname, targets):
    """An op asking for its generic kernel gets the table's kernel for `targets`."""
    attr = kt.attr_name(opname)

    def pat(b, op, operands):
        if op.attrs.get(attr) != kt.GENERIC:
            return None
        found = kt.choose(opname, [v.type for v in op.operands], op.attrs, targets)
        if found is None:
            return None
        new = b.graph.add_op(op.opname, operands, {**op.attrs, attr: found.kernel},
                             [r.type for r in op.results], op.loc,
                             names=[r.name for r in op.results])
        return new.results
    return pat


def settle_patterns(targets, ops=None, strategy="auto", recoded=None) -> dict:
    """The rewrite patterns of this pass (op name -> [pattern]) for `targets`, for the
    table's ops or those of them in `ops`; the ternary pass runs them with its own."""
    recoded = {} if recoded is None else recoded
    out = {}
    for name in kt.ops():
        if ops is not None and name not in ops:
            continue
        out[name] = [_settle_ternary(strategy, targets, recoded) if name in kt.UNSETTLED
                     else _settle(name, targets)]
    return out


@register_pass("kernels")
def kernels(graph: Graph, targets=("llvm-cpu",), ops=None, strategy: str = "auto") -> Graph:
    """Give every op of the kernel table (or of `ops`) that asks for its generic kernel
    (a ternary matmul: "auto") the table's kernel for `targets`; explicit choices stay."""
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    check_strategy(strategy, targets, choices=("auto", *kt.kernel_names("ternary_matmul")))
    recoded = {}
    out = rewrite(graph, settle_patterns(targets, ops, strategy, recoded))
    return take_names(dce(out), recoded) if recoded else out
