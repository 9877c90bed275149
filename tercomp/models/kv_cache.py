"""The decoder's KV cache: the protocol a model's forward asks of one, and tc.compile_lm's
implementation.

A decoder (models/bitnet.py) takes `cache=None` for the training / `tc.compile` forward
(causal attention over the call's own tokens, positions 0..T-1), or an object of the
`KVCacheProtocol` (the role of Hugging Face's `past_key_values`):

    cache.max_seq                 rows of the cache per sequence (the rotary tables' length)
    cache.positions(ids)          absolute positions of the call's tokens, int32 [T]
                                  (ids [1, T]); the rotary tables are read at them
    cache.layer(i).attend(q, k, v, scale, window=None)
                                  writes this call's k, v [1, T, KV, D] of layer i into
                                  the cache and returns the causal attention of q
                                  [1, T, H, D] over every row filled so far [1, T, H, D]
                                  (with `window` W, a sliding-window layer's: over the W
                                  most recent rows up to each query's own position)
    cache.updated                 the written cache tensors, [k_0, v_0, k_1, v_1, ...],
                                  which the compiled step stores back (runtime/step_abi.py)

`KVCache` is tc.compile_lm's: one tensor per layer for K and for V (the traced values of
the device globals that keep them between calls). For one sequence (`start=`) each is
[max_seq, KV, D], written at `start` with `tern.cache_write` and read with
`tern.cached_attention` (rows 0..start+T-1 only). For the batched generator (`slots=`,
`positions=`) each is [N, max_seq, KV, D], one sequence per slot, and a call's T tokens
each name their slot and position (several sequences' decode steps and prompt chunks in
one call): `tern.kv_scatter` writes them, `tern.slot_attention` reads each token's slot
up to its position (ops/kv_slots.py).
"""
from __future__ import annotations

from typing import Protocol

from ..tracing.tracer import apply


class LayerCacheProtocol(Protocol):
    def attend(self, q, k, v, scale: float, window: int | None = None): ...


class KVCacheProtocol(Protocol):
    """What a decoder's forward and tc.compile_lm's step read of a KV cache."""
    max_seq: int
    updated: list

    def positions(self, ids): ...

    def layer(self, i: int) -> LayerCacheProtocol: ...


class KVCache:
    """caches: [k_0, v_0, k_1, v_1, ...] traced values of `dtype`; either `start` (one
    sequence: the traced int32 position of the call's first token; caches [max_seq, KV,
    D]) or `slots` and `positions` (traced int32 [T]: the slot and position of each token
    of the call, which the model sees as one row of ids [1, T]; caches [N, max_seq, KV,
    D])."""

    def __init__(self, caches, dtype: str, *, start=None, slots=None, positions=None):
        if (start is None) == (slots is None) or (slots is None) != (positions is None):
            raise TypeError("KVCache takes start= (one sequence) or slots= and positions=")
        self.caches = list(caches)
        self.dtype = dtype
        self.start, self.slots, self.pos = start, slots, positions
        self.updated = list(self.caches)

    @property
    def max_seq(self) -> int:
        return int(self.caches[0].shape[-3])

    def positions(self, ids):
        if self.slots is None:
            return apply("arange", ids.reshape(-1), self.start)
        return self.pos

    def layer(self, i: int) -> "_LayerCache":
        return _LayerCache(self, i)


class _LayerCache:
    def __init__(self, cache: KVCache, index: int):
        self.cache, self.index = cache, index

    def attend(self, q, k, v, scale: float, window: int | None = None):
        c, i = self.cache, 2 * self.index
        win = {} if window is None else {"window": int(window)}
        kv, d = k.shape[-2], k.shape[-1]

        def write(j, x):
            x = x.reshape(-1, kv, d).astype(c.dtype)
            if c.slots is None:
                return apply("cache_write", c.caches[i + j], x, c.start)
            return apply("kv_scatter", c.caches[i + j], x, c.slots, c.pos)
        kc, vc = write(0, k), write(1, v)
        c.updated[i], c.updated[i + 1] = kc, vc
        rows = q.reshape(-1, q.shape[-2], d)
        if c.slots is None:
            out = apply("cached_attention", rows, kc, vc, c.start, scale=float(scale), **win)
        else:
            out = apply("slot_attention", rows, kc, vc, c.slots, c.pos, scale=float(scale), **win)
        return out.reshape(*q.shape)
