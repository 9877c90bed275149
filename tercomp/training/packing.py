"""Packed parameters: a compiled step's float32 parameters, and every optimizer-state tree
shaped like them (Adam's moments, SGD's momentum, an accumulation's gradient sum), each
kept on the device as ONE vector.

An optimizer whose update treats every parameter element alone (`Optimizer.elementwise`:
SGD, AdamW) then runs on whole vectors: the clipping norm is one reduction, the update one
pass over memory, instead of a few small dispatches per parameter (a 3-layer LM's 35
parameters were ~140 of its step's 400 dispatches and a fifth of its compile time). The
forward reads each parameter as a slice of the vector (no copy); the gradients are
concatenated into one (one copy a step).

Packing is internal to TrainStep: its `params()`, `opt_state()`, `set_state()` and the
checkpoints see the usual trees, converted here.

    >>> packing = Packing.of(params, optimizer)          # None where it does not apply
    >>> packed = packing.pack_tree(optimizer.init(params))   # {"mu": {"packed": [P]}, ...}
    >>> packing.unpack_tree(packed)                      # the tree init(params) gave
"""
from __future__ import annotations

import numpy as np

from .. import pytree
from ..trace import api as _t
from ..trace.tracer import apply

KEY = "packed"


class Packing:
    """Where each parameter sits in the packed vector (pytree order of the params dict)."""

    def __init__(self, params: dict):
        leaves, paths, _ = pytree.flatten(params)
        self.names = list(paths)
        self.shapes = [tuple(np.shape(x)) for x in leaves]
        self.offsets = np.cumsum([0] + [int(np.prod(s)) for s in self.shapes]).tolist()
        self.size = self.offsets[-1]

    @classmethod
    def of(cls, params: dict, optimizer) -> "Packing | None":
        """A Packing for `params` under `optimizer`, or None: the optimizer must declare
        an elementwise update and every parameter must be a float32 array."""
        if not getattr(optimizer, "elementwise", False) or not params:
            return None
        if not all(np.asarray(v).dtype == np.float32 for v in params.values()):
            return None
        return cls(params)

    def _params_like(self, tree) -> bool:
        return (isinstance(tree, dict) and sorted(tree, key=str) == sorted(self.names, key=str)
                and all(tuple(np.shape(tree[k])) == s for k, s in zip(self.names, self.shapes)))

    # -- host trees ------------------------------------------------------------------------
    def pack_tree(self, tree):
        """`tree` with each params-shaped dict replaced by {"packed": its vector}."""
        if self._params_like(tree):
            return {KEY: np.concatenate([np.asarray(tree[k], np.float32).reshape(-1)
                                         for k in self.names])}
        if isinstance(tree, dict):
            return {k: self.pack_tree(v) for k, v in tree.items()}
        return tree

    def unpack_tree(self, tree):
        """The inverse of pack_tree (on host arrays)."""
        if isinstance(tree, dict) and set(tree) == {KEY}:
            flat = np.asarray(tree[KEY])
            return {k: flat[a:b].reshape(s) for k, s, a, b in
                    zip(self.names, self.shapes, self.offsets, self.offsets[1:])}
        if isinstance(tree, dict):
            return {k: self.unpack_tree(v) for k, v in tree.items()}
        return tree

    # -- traced ----------------------------------------------------------------------------
    def slices(self, packed) -> dict:
        """The parameters as pieces of the traced vector `packed` ({"packed": vector}):
        one split whose offsets are run-time values in the compiled code. IREE folds a
        slice into the code of its consumers; with the offsets constants there, each
        layer's dispatches would be compiled once per offset (90 executables for a
        3-layer LM instead of 70)."""
        pieces = apply("split", packed[KEY], axis=0, runtime_offsets=True,
                       sizes=[b - a for a, b in zip(self.offsets, self.offsets[1:])])
        pieces = pieces if isinstance(pieces, (tuple, list)) else [pieces]
        return {k: _t.reshape(x, s) for k, s, x in zip(self.names, self.shapes, pieces)}

    def concatenate(self, grads: dict) -> dict:
        """Traced gradients (a params-shaped dict) as {"packed": one vector}."""
        return {KEY: _t.concatenate([_t.reshape(grads[k], (-1,)) for k in self.names])}
