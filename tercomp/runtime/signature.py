"""The signature of a compiled function: names, shapes (with symbolic dims), dtypes and
the pytree structure of arguments and results. Plain JSON, so artifacts carry it."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..errors import InputError


def _np_dtypes() -> dict:
    from ..ir.types import DTYPES
    return {k: np.dtype(v[0]) for k, v in DTYPES.items()}


_NP_DTYPES = _np_dtypes()


@dataclass
class TensorSig:
    name: str
    shape: list        # ints, or strings for symbolic dims ("B", "2*B")
    dtype: str         # tern dtype name: "f32", "i32", ...

    def describe(self):
        return f"{self.name}: [{', '.join(str(d) for d in self.shape)}] {self.dtype}"


@dataclass
class Signature:
    function: str
    inputs: list
    outputs: list
    in_tree: object = None
    out_tree: object = None

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> "Signature":
        return Signature(d["function"], [TensorSig(**t) for t in d["inputs"]],
                         [TensorSig(**t) for t in d["outputs"]], d.get("in_tree"), d.get("out_tree"))

    @staticmethod
    def from_graph(graph) -> "Signature":
        from ..pytree import jsonable

        def sig(name, t):
            return TensorSig(name, [d if isinstance(d, int) else str(d) for d in t.shape], t.dtype)
        return Signature(graph.name, [sig(v.name, v.type) for v in graph.inputs],
                         [sig(n, v.type) for n, v in zip(graph.output_names, graph.outputs)],
                         jsonable(graph.meta.get("in_tree")), jsonable(graph.meta.get("out_tree")))

    def check_inputs(self, leaves) -> list:
        """Check count, shapes and dtypes; returns contiguous arrays. Symbolic dims must
        agree across inputs (every 'B' the same size)."""
        from ..ir.types import DTYPES, dtype_name
        if len(leaves) != len(self.inputs):
            raise InputError(f"{self.function} takes {len(self.inputs)} input arrays "
                             f"({', '.join(s.name for s in self.inputs)}), got {len(leaves)}")
        bindings: dict = {}
        out = []
        for x, s in zip(leaves, self.inputs):
            if hasattr(x, "to_host") and hasattr(x, "shape") and not isinstance(x, np.ndarray):
                arr = x                      # a device array: checked by shape/dtype only
                shape, dt = tuple(x.shape), np.dtype(x.dtype)
            else:
                arr = np.asarray(x)
                shape, dt = arr.shape, arr.dtype
            if dt != _NP_DTYPES.get(s.dtype):
                try:
                    got = dtype_name(dt)
                except ValueError:
                    got = str(dt)
                if got != s.dtype:
                    raise InputError(f"input {s.name}: expected dtype {s.dtype}, got {got}",
                                     hint=f"convert with .astype(np.{np.dtype(DTYPES[s.dtype][0]).name})")
            if len(shape) != len(s.shape):
                raise InputError(f"input {s.name}: expected shape [{', '.join(map(str, s.shape))}], got "
                                 f"{list(shape)} (rank {len(shape)} instead of {len(s.shape)})")
            for k, (want, have) in enumerate(zip(s.shape, shape)):
                if isinstance(want, int):
                    if want != have:
                        raise InputError(f"input {s.name}: expected shape [{', '.join(map(str, s.shape))}], "
                                         f"got {list(shape)} (dim {k} must be {want})")
                elif want in bindings and bindings[want] != have:
                    raise InputError(f"input {s.name}: dim {k} ({want}) is {have} but {want} = "
                                     f"{bindings[want]} in an earlier input")
                else:
                    bindings[want] = have
            # np.ascontiguousarray would turn a 0-d array into shape (1,)
            out.append(np.asarray(arr, order="C") if isinstance(arr, np.ndarray) else arr)
        return out
