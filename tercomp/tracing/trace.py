"""`tc.trace(fn, *example_args)`: turn a Python function (or nn.Module) into a Graph."""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import numpy as np

from ..errors import TercompError, TraceError
from ..ir import Graph, TensorType
from ..ir.types import dtype_name
from .. import pytree
from .tracer import Trace, Tracer, user_location


@dataclass(frozen=True)
class Spec:
    """An example argument given by shape and dtype; dims may be names ("B")."""
    shape: tuple
    dtype: str = "f32"

    @property
    def type(self) -> TensorType:
        return TensorType(tuple(self.shape), self.dtype)


# the sympy types of symbolic dims, as TypeErrors name them ('Symbol' object cannot be
# interpreted as an integer)
_SYMBOLIC_TYPES = ("'Symbol'", "'Mul'", "'Add'", "'Pow'", "'floor'")


def spec(shape, dtype="float32") -> Spec:
    """`tc.spec(("B", 784), "float32")`: an input whose dim B is symbolic."""
    try:
        s = Spec(tuple(shape), dtype_name(dtype))
        s.type          # checks every dim now, not at trace time
        return s
    except (ValueError, TypeError, TercompError) as e:
        raise TraceError(str(e), loc=user_location()) from None


def leaf_type(x, path="") -> TensorType:
    if isinstance(x, Spec):
        return x.type
    if isinstance(x, Tracer):
        return x.value.type
    if isinstance(x, (bool, int, float)):
        x = np.asarray(x, dtype=np.float32 if isinstance(x, float) else None)
    if isinstance(x, np.ndarray) or np.isscalar(x):
        x = np.asarray(x)
        try:
            return TensorType(x.shape, dtype_name(x.dtype))
        except ValueError as e:
            raise TraceError(f"argument {path or '?'}: {e}", loc=user_location()) from None
    raise TraceError(f"argument {path or '?'} is a {type(x).__name__}, not an array",
                     loc=user_location(), hint="pass NumPy arrays, tc.spec(...) or pytrees of them")


def _arg_names(fn, n):
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = []
    for i in range(n):
        if i < len(params) and params[i].kind in (params[i].POSITIONAL_ONLY, params[i].POSITIONAL_OR_KEYWORD):
            names.append(params[i].name)
        elif params and params[-1].kind == params[-1].VAR_POSITIONAL:
            names.append(f"{params[-1].name}{i}")
        else:
            names.append(f"arg{i}")
    return names


def _swap_module(module, values: dict):
    module._load_params(values)
    return module


def trace(fn, *example_args, name: str = "forward") -> Graph:
    """Trace `fn(*example_args)` into a tern Graph.

    >>> g = tc.trace(lambda x: tc.relu(x) * 2, tc.spec(("B", 4)))
    >>> print(g)   # tern IR text

    Every array or spec in `example_args` (a pytree) becomes a function input. If `fn`
    is an nn.Module, its parameters become named constants (weights); if an argument is
    a Module, its parameters become inputs named after it (`model.fc1.weight`).
    """
    graph = Graph(name=name)
    captured = None
    call = fn
    if pytree.is_module(fn):
        captured = fn
        call = fn.__call__
        names = _arg_names(fn.forward, len(example_args))
    else:
        names = _arg_names(fn, len(example_args))
    leaves, paths, in_tree = pytree.flatten(tuple(example_args))
    paths = [names[int(p.split(".")[0])] + p[len(p.split(".")[0]):] for p in paths]
    modules_in_args = []

    with Trace(graph) as tr:
        inputs = [Tracer(graph.add_input(p, leaf_type(x, p)), tr) for x, p in zip(leaves, paths)]
        saved = []

        def on_module(m, vals):
            saved.append((m, m.parameters()))
            modules_in_args.append(m)
            return _swap_module(m, vals)
        args = pytree.unflatten(in_tree, inputs, on_module=on_module)
        if captured is not None:
            params = captured.parameters()
            saved.append((captured, params))
            consts = {n: Tracer(tr.const(np.asarray(v), name=n, loc=user_location()), tr)
                      for n, v in params.items()}
            _swap_module(captured, consts)
        try:
            result = call(*args)
        except TypeError as e:
            if not any(t in str(e) for t in _SYMBOLIC_TYPES):
                raise
            raise TraceError(f"a symbolic dim was used where Python needs an int ({e})",
                             loc=user_location(e.__traceback__),
                             hint="a loop or range() over a symbolic size cannot be unrolled: use "
                                  "tc.scan, or trace with a static size") from None
        finally:
            for m, p in reversed(saved):
                m._load_params(p)
        out_leaves, out_paths, out_tree = pytree.flatten(result)
        outs = []
        for x, p in zip(out_leaves, out_paths):
            if isinstance(x, Tracer):
                if x.trace is not tr:
                    raise TraceError("the function returned a value from another trace", loc=user_location())
                outs.append(x.value)
            else:
                leaf_type(x, f"result {p}")
                outs.append(tr.const(np.asarray(x), name=p or "out"))
    graph.set_outputs(outs, output_names(out_tree, out_paths, outs))
    graph.meta["in_tree"] = in_tree
    graph.meta["out_tree"] = out_tree
    graph.meta["input_paths"] = paths
    return graph


def output_names(out_tree, out_paths: list, outs: list) -> list:
    """The names of a traced function's results, by one rule:

    - a result the returned structure names (under a dict key, or a parameter of a
      returned module) is named by its path: `loss`, `grads.fc1.weight`;
    - a positional result (the lone result, or one inside a returned tuple or list) is
      `out`, `out0`, `out1_w`, ..., unless autodiff made it a gradient (`Value.grad_of`),
      which keeps the name autodiff gave it (`x.grad`, `model.fc1.weight.grad`), so that
      `tc.grad`'s results are named after their primals.
    """
    positional = out_tree is None or out_tree[0] in ("tuple", "list")
    if not positional:
        return list(out_paths)
    return [v.name if v.grad_of is not None else "out" + p.replace(".", "_")
            for p, v in zip(out_paths, outs)]
