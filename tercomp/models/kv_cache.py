"""The decoder's cache protocol: what a model's forward asks of a KV cache.

A decoder (models/bitnet.py) takes `cache=None` for the training / `tc.compile` forward
(causal attention over the call's own tokens, positions 0..T-1), or a cache object with
these two methods (the role of Hugging Face's `past_key_values`):

    cache.positions(ids)          absolute positions of the call's tokens, int32 [T]
                                  (ids [1, T]); the rotary tables are read at them
    cache.layer(i).attend(q, k, v, scale)
                                  writes this call's k, v [1, T, KV, D] of layer i into
                                  the cache and returns the causal attention of q
                                  [1, T, H, D] over every row filled so far [1, T, H, D]

`StaticKVCache` is tc.compile_lm's: one [max_seq, KV, D] tensor per layer for K and
for V (the traced values of the device globals that keep them between calls), written
at `start` with `tern.cache_write` and read with `tern.cached_attention` (rows
0..start+T-1 only). The written tensors are `cache.updated`, in the order given, for
the compiled step to store back.

`SlotKVCache` is the batched generator's (tc.compile_lm with max_batch > 1): one
[max_batch, max_seq, KV, D] tensor per layer for K and for V, one sequence per slot,
and a call whose T tokens each name their slot and position (several sequences'
decode steps and prompt chunks in one call): `tern.kv_scatter` writes them,
`tern.slot_attention` reads each token's slot up to its position (ops/kv_slots.py).
"""
from __future__ import annotations

from ..trace.tracer import apply


class StaticKVCache:
    """caches: [k_0, v_0, k_1, v_1, ...] traced [max_seq, KV, D] values of `dtype`;
    start: the traced int32 position of the call's first token (one sequence)."""

    def __init__(self, caches, start, dtype: str):
        self.caches = list(caches)
        self.start = start
        self.dtype = dtype
        self.updated = list(self.caches)

    @property
    def max_seq(self) -> int:
        return int(self.caches[0].shape[0])

    def positions(self, ids):
        return apply("arange", ids.reshape(-1), self.start)

    def layer(self, i: int) -> "_LayerCache":
        return _LayerCache(self, i)


class _LayerCache:
    def __init__(self, cache: StaticKVCache, index: int):
        self.cache, self.index = cache, index

    def attend(self, q, k, v, scale: float):
        c, i = self.cache, 2 * self.index
        kv, d = k.shape[-2], k.shape[-1]
        kc = apply("cache_write", c.caches[i], k.reshape(-1, kv, d).astype(c.dtype), c.start)
        vc = apply("cache_write", c.caches[i + 1], v.reshape(-1, kv, d).astype(c.dtype), c.start)
        c.updated[i], c.updated[i + 1] = kc, vc
        out = apply("cached_attention", q.reshape(-1, q.shape[-2], d), kc, vc, c.start,
                    scale=float(scale))
        return out.reshape(*q.shape)


class SlotKVCache:
    """caches: [k_0, v_0, ...] traced [N, max_seq, KV, D] values of `dtype`; slots and
    positions: traced int32 [T], the slot and position of each token of the call (the
    model sees the T tokens as one row of ids [1, T])."""

    def __init__(self, caches, slots, positions, dtype: str):
        self.caches = list(caches)
        self.slots, self.pos = slots, positions
        self.dtype = dtype
        self.updated = list(self.caches)

    @property
    def max_seq(self) -> int:
        return int(self.caches[0].shape[1])

    def positions(self, ids):
        return self.pos

    def layer(self, i: int) -> "_SlotLayerCache":
        return _SlotLayerCache(self, i)


class _SlotLayerCache:
    def __init__(self, cache: SlotKVCache, index: int):
        self.cache, self.index = cache, index

    def attend(self, q, k, v, scale: float):
        c, i = self.cache, 2 * self.index
        kv, d = k.shape[-2], k.shape[-1]
        kc, vc = (apply("kv_scatter", c.caches[j], x.reshape(-1, kv, d).astype(c.dtype), c.slots, c.pos)
                  for j, x in ((i, k), (i + 1, v)))
        c.updated[i], c.updated[i + 1] = kc, vc
        out = apply("slot_attention", q.reshape(-1, q.shape[-2], d), kc, vc, c.slots, c.pos,
                    scale=float(scale))
        return out.reshape(*q.shape)
