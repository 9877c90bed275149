"""The reference interpreter: run a Graph with each op's NumPy reference."""
from __future__ import annotations

import numpy as np

from ..errors import TercompError, InputError, ExecutionError
from ..ir import Graph
from .registry import get
from .shape_util import bind_symbols


def interpret(graph: Graph, *inputs, return_env: bool = False):
    """Evaluate `graph` on NumPy arrays; returns the list of outputs."""
    if len(inputs) != len(graph.inputs):
        raise InputError(f"{graph.name} takes {len(graph.inputs)} inputs, got {len(inputs)}")
    env = {}
    bindings = {}
    for v, x in zip(graph.inputs, inputs):
        env[v] = np.asarray(x)
        for d, n in zip(v.type.shape, env[v].shape):
            if not isinstance(d, int) and d.is_Symbol:
                bindings[d] = n
    with bind_symbols(bindings):
        _run(graph, env)
    outs = [env[v] for v in graph.outputs]
    return (outs, env) if return_env else outs


def _run(graph: Graph, env: dict):
    for op in graph.ops:
        opdef = get(op.opname)
        try:
            outs = opdef.reference([env[v] for v in op.operands], op.attrs)
        except TercompError:
            raise
        except Exception as e:
            raise ExecutionError(f"the reference of tern.{op.opname} failed: {e}", loc=op.loc) from None
        for r, o in zip(op.results, outs):
            env[r] = np.asarray(o)
