"""Packed parameters: a compiled step's float32 parameters, and every optimizer-state tree
shaped like them (Adam's moments, SGD's momentum, an accumulation's gradient sum), each
kept on the device as ONE vector.

An optimizer whose update treats every parameter element alone (`Optimizer.elementwise`:
SGD, AdamW) then runs on whole vectors: the clipping norm is one reduction, the update one
pass over memory, instead of a few small dispatches per parameter (a 3-layer LM's 35
parameters were ~140 of its step's 400 dispatches and a tenth of its compile time). The
forward reads each parameter as a slice of the vector, which IREE folds into the code
that reads it (no copy for vectors and matrices); the gradients are concatenated into
one (a copy a step). Data-parallel steps Allreduce that packed gradient.

Packing is internal to TrainStep: its `params()`, `opt_state()`, `set_state()` and the
checkpoints see the usual trees, converted here.

    >>> packing = Packing.of(params, optimizer)          # None where it does not apply
    >>> packed = packing.pack_tree(optimizer.init(params))   # {"mu": {"packed": [P]}, ...}
    >>> packing.unpack_tree(packed)                      # the tree init(params) gave
"""
from __future__ import annotations

import numpy as np

from .. import pytree
from ..tracing import api as _t
from ..tracing.tracer import apply

KEY = "packed"


#: The largest common multiple of the matrix widths the packed vector's length is padded
#: to (so that every width divides it); beyond it the matrices are read through copies,
#: as parameters of other ranks are.
MAX_PAD = 1 << 16
#: The longest packed vector: more elements than an int32 counts (a 2B-parameter model)
#: stay one tensor per parameter, each far below it.
MAX_ELEMENTS = 2**31 - 1


class Packing:
    """Where each parameter sits in the packed vector (pytree order of the params dict).

    A matrix [N, K] starts at a multiple of K and the vector's length is a multiple of
    every such K, so the forward reads it as rows of the vector viewed as [size / K, K]:
    a slice IREE folds into the code that reads it, with the row a run-time value (the
    code is shared by every layer, and nothing is copied). Gaps are zeros, which the
    updates keep zero."""

    def __init__(self, params: dict):
        leaves, paths, _ = pytree.flatten(params)
        self.names = list(paths)
        self.shapes = [tuple(np.shape(x)) for x in leaves]
        widths = sorted({s[1] for s in self.shapes if len(s) == 2})
        lcm = int(np.lcm.reduce(widths)) if widths else 1
        self.rows_view = lcm <= MAX_PAD          # matrices as rows of [size / K, K] views
        self.offsets, at = [], 0
        for shape in self.shapes:
            if len(shape) == 2 and self.rows_view:
                at = -(-at // shape[1]) * shape[1]
            self.offsets.append(at)
            at += int(np.prod(shape))
        self.size = -(-at // lcm) * lcm if self.rows_view else at

    def _pieces(self):
        return zip(self.names, self.shapes, self.offsets)

    @classmethod
    def of(cls, params: dict, optimizer) -> "Packing | None":
        """A Packing for `params` under `optimizer`, or None: the optimizer must declare
        an elementwise update, every parameter must be a float32 array, and the vector
        must hold at most MAX_ELEMENTS."""
        if not getattr(optimizer, "elementwise", False) or not params:
            return None
        if not all(np.asarray(v).dtype == np.float32 for v in params.values()):
            return None
        packing = cls(params)
        return packing if packing.size <= MAX_ELEMENTS else None

    def _params_like(self, tree) -> bool:
        return (isinstance(tree, dict) and sorted(tree, key=str) == sorted(self.names, key=str)
                and all(tuple(np.shape(tree[k])) == s for k, s in zip(self.names, self.shapes)))

    # -- host trees ------------------------------------------------------------------------
    def pack_tree(self, tree):
        """`tree` with each params-shaped dict replaced by {"packed": its vector}."""
        if self._params_like(tree):
            flat = np.zeros(self.size, np.float32)
            for k, shape, at in self._pieces():
                flat[at:at + int(np.prod(shape))] = np.asarray(tree[k], np.float32).reshape(-1)
            return {KEY: flat}
        if isinstance(tree, dict):
            return {k: self.pack_tree(v) for k, v in tree.items()}
        return tree

    def unpack_tree(self, tree):
        """The inverse of pack_tree (on host arrays)."""
        if isinstance(tree, dict) and set(tree) == {KEY}:
            flat = np.asarray(tree[KEY])
            return {k: flat[at:at + int(np.prod(shape))].reshape(shape)
                    for k, shape, at in self._pieces()}
        if isinstance(tree, dict):
            return {k: self.unpack_tree(v) for k, v in tree.items()}
        return tree

    # -- traced ----------------------------------------------------------------------------
    def slices(self, packed) -> dict:
        """The parameters as slices of the traced vector `packed` ({"packed": vector})
        at run-time offsets (tern.slice runtime_offsets): IREE folds a slice into the
        code of its consumers, and with the offset a constant there the same dispatch of
        every layer was compiled once per offset (90 executables for a 3-layer LM, 73
        this way). Matrices are rows of a [size / K, K] view (see the class)."""
        flat, views, out = packed[KEY], {}, {}
        for k, shape, at in self._pieces():
            n = int(np.prod(shape))
            if len(shape) == 2 and self.rows_view:
                width = shape[1]
                if width not in views:
                    views[width] = _t.reshape(flat, (self.size // width, width))
                out[k] = apply("slice", views[width], starts=[at // width, 0],
                               stops=[at // width + shape[0], width], steps=[1, 1],
                               runtime_offsets=True)
            else:
                piece = apply("slice", flat, starts=[at], stops=[at + n], steps=[1],
                              runtime_offsets=True)
                out[k] = piece if len(shape) == 1 else _t.reshape(piece, shape)
        return out

    def concatenate(self, grads: dict) -> dict:
        """Traced gradients (a params-shaped dict) as {"packed": one vector}, zeros in the
        gaps."""
        parts, at = [], 0
        for k, shape, start in self._pieces():
            if start > at:
                parts.append(np.zeros(start - at, np.float32))
            parts.append(_t.reshape(grads[k], (-1,)))
            at = start + int(np.prod(shape))
        if self.size > at:
            parts.append(np.zeros(self.size - at, np.float32))
        return {KEY: _t.concatenate(parts)}
