"""The `kernels` pass: which hand-written kernel each row-wise LM op takes, chosen from
the targets, so that the traced IR is the same on every host.

A model traces its ops with `kernel="generic"` (the op's linalg lowering, which every
target compiles). For a module compiled for the host CPU alone (`llvm-cpu`), this pass
picks the hand-written dispatches measured faster there (see codegen/rows_cpu.py,
codegen/attention_cpu.py, codegen/dense_avx2.py); each lowering still falls back to the
generic form where its kernel does not fit the shape.

    op                  kernel     where
    rms_norm            "cpu"      llvm-cpu alone (f32 rows of a width that fits)
    rope                "cpu"      llvm-cpu alone ("neox" pairs, one sequence)
    cached_attention    "cpu"      llvm-cpu alone
    slot_attention      "cpu"      llvm-cpu alone
    widening_matmul     "avx2"     llvm-cpu alone on an AVX2 host

The ternary matmul strategies have their own table and pass (`ternary`,
codegen/ternary_strategies.py).
"""
from __future__ import annotations

from ..codegen.ternary_strategies import AVX2, target_features
from ..ir import Graph
from .manager import register_pass
from .rewrite import rewrite


def kernel_table(targets) -> dict:
    """op name -> the kernel attribute it takes for `targets`."""
    targets = [targets] if isinstance(targets, str) else list(targets)
    if targets != ["llvm-cpu"]:
        return {}
    table = {"rms_norm": "cpu", "rope": "cpu", "cached_attention": "cpu", "slot_attention": "cpu"}
    if AVX2 in target_features(targets):
        table["widening_matmul"] = "avx2"
    return table


@register_pass("kernels")
def kernels(graph: Graph, targets=("llvm-cpu",)) -> Graph:
    """Set the `kernel` attribute of the ops in kernel_table(targets) that ask for the
    generic one (an explicit choice in the IR is kept)."""
    table = kernel_table(targets)

    def choose(kernel):
        def pat(b, op, operands):
            if op.attrs.get("kernel") != "generic":
                return None
            new = b.graph.add_op(op.opname, operands, {**op.attrs, "kernel": kernel},
                                 [r.type for r in op.results], op.loc,
                                 names=[r.name for r in op.results])
            return new.results
        return pat
    if not table:
        return graph
    return rewrite(graph, {name: [choose(k)] for name, k in table.items()})
