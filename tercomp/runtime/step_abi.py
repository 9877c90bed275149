"""The compiled language-model step's calling convention: ONE definition that the compile
side (tc.compile_lm, tercomp/generate.py) and the runtime side (runtime/generator.py,
runtime/batched.py, the checks of a loaded artifact) both read.

    step(ids i32[T], start i32, rows i32[L])                    one sequence
    step(ids i32[T], slots i32[T], positions i32[T], rows i32[L])   max_batch > 1
        -> logits f32[L, vocab]

`start` is a plain i32 argument, not a 0-d tensor (lowering/state.py `Entry.scalars`: a
tensor's value would be read back through the queue on every call); modules compiled
before took it as a tensor, which the generator still accepts (`scalar_inputs`).
Token t of the call is at position start + t (one sequence), or at positions[t] of the
sequence in cache slot slots[t]; `rows` picks the positions of the call whose logits
are computed. The KV caches kv0, kv1, ... (K and V of each layer: [max_seq, KV, D], or
[max_batch, max_seq, KV, D]) are mutable globals of the module: the traced step takes
them after its named inputs and returns their new values after the logits, and the
exported function binds both to the globals (lowering/state.py), so a caller passes the
named inputs only.

A batched module (max_batch > 1) has a second function over the same globals, which
copies KV rows between slots (runtime.Engine shares a running sequence's prompt prefix
with a new request through it):

    copy_rows(src i32[R], dst i32[R], positions i32[R])
        row positions[r] of slot src[r] -> row positions[r] of slot dst[r], every cache

The (dst, position) pairs must be distinct and none of them a source row.

    >>> abi = StepABI.of(max_batch=1)
    >>> abi.inputs, abi.bind_inputs(4)
    (('ids', 'start', 'rows'), {3: 'kv0', 4: 'kv1', 5: 'kv2', 6: 'kv3'})
"""
from __future__ import annotations

from dataclasses import dataclass

#: the exported function of a compiled LM
STEP = "step"
#: a batched LM's KV row copy between slots
COPY = "copy_rows"
#: copy_rows' named inputs (i32 [R] each), before the caches
COPY_INPUTS = ("src", "dst", "positions")

_SINGLE = (("ids", ("T",)), ("start", ()), ("rows", ("L",)))
_BATCHED = (("ids", ("T",)), ("slots", ("T",)), ("positions", ("T",)), ("rows", ("L",)))
#: the named inputs passed as scalars (0-d in the traced step)
_SCALARS = ("start",)


@dataclass(frozen=True)
class StepABI:
    """The step of a single-sequence (`batched=False`) or a batched generator."""
    batched: bool
    function: str = STEP

    @classmethod
    def of(cls, max_batch: int) -> "StepABI":
        return cls(batched=max_batch > 1)

    @property
    def inputs(self) -> tuple:
        """The named inputs, in order (int32 each)."""
        return tuple(n for n, _ in (_BATCHED if self.batched else _SINGLE))

    @property
    def input_shapes(self) -> tuple:
        """Each named input's shape, with the symbolic dims "T" (tokens) and "L" (rows)."""
        return tuple(s for _, s in (_BATCHED if self.batched else _SINGLE))

    @property
    def scalars(self) -> frozenset:
        """The indices of the named inputs the exported step takes as i32 scalars."""
        return frozenset(i for i, n in enumerate(self.inputs) if n in _SCALARS)

    @property
    def input_ranks(self) -> list:
        """(rank, "i32") of each named input, as a module's declaration shows them (None
        for a scalar: signature.declared_types reads only tensors)."""
        return [None if i in self.scalars else (len(s), "i32")
                for i, s in enumerate(self.input_shapes)]

    def scalar_inputs(self, declared: list) -> bool | None:
        """Whether a module whose step declares `declared` (signature.declared_types'
        inputs) takes the scalars as scalars (True: this tercomp's modules) or as 0-d
        tensors (False: an earlier one's), or None where it matches neither."""
        ranks = [t and (len(t[0]), t[1]) for t in declared]
        if ranks == self.input_ranks:
            return True
        tensors = [(0, "i32") if r is None else r for r in self.input_ranks]
        return False if ranks == tensors else None

    @staticmethod
    def cache_names(n_caches: int) -> list:
        return [f"kv{i}" for i in range(n_caches)]

    def bind_inputs(self, n_caches: int, named: int | None = None) -> dict:
        """{traced input index: cache global}: the caches follow the `named` inputs
        (default the step's)."""
        first = len(self.inputs) if named is None else named
        return {first + i: name for i, name in enumerate(self.cache_names(n_caches))}

    @staticmethod
    def bind_outputs(n_caches: int, first: int = 1) -> dict:
        """{traced output index: cache global}: the caches follow the logits (`first`
        1), or are every output (`first` 0: copy_rows)."""
        return {first + i: name for i, name in enumerate(StepABI.cache_names(n_caches))}

    @property
    def entries(self) -> list:
        """The module's exported functions: the step, and copy_rows where batched."""
        return [self.function, COPY] if self.batched else [self.function]

    def cache_shape(self, max_batch: int, max_seq: int, kv_heads: int, head_dim: int) -> tuple:
        rows = (max_seq, kv_heads, head_dim)
        return (max_batch,) + rows if self.batched else rows
