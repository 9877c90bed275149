"""A digest of a Graph that changes with anything in it: the compile cache's key of a
traced program (tercomp/pipeline.py).

The text (ops, attributes, types, value names, source locations, nested bodies) is the
printer's, constants elided (and source locations left out unless asked for: they
change no compiled code, only the messages of passes such as check_numerics); every constant's dtype, shape and bytes are hashed in op
order beside it, and so is the graph's `meta` (the pytree structure of the arguments and
results, which the text does not show). Two graphs with the same digest print the same
with `elide=False` and have the same meta.

    >>> digest(tc.trace(f, x)) == digest(tc.trace(f, x))
    True
"""
from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor

import blake3
import numpy as np

from .graph import Graph, regions
from .printer import print_graph

#: arrays of this many bytes or more are hashed on a thread pool (blake3 releases the
#: GIL on large buffers, so a 700M model's ~220 MB of weights take half the time on 2 cores)
_PARALLEL_BYTES = 1 << 20


def digest(g: Graph, locations: bool = False) -> str:
    """sha256 hex digest of everything in `g` (see the module docstring; each constant's
    bytes through BLAKE3), its ops' source locations too with `locations`."""
    h = hashlib.sha256()
    text = print_graph(g, locations=locations).encode()
    h.update(len(text).to_bytes(8, "little") + text)
    meta = json.dumps(g.meta, sort_keys=True, default=repr).encode()
    h.update(len(meta).to_bytes(8, "little") + meta)
    arrays = list(_constants(g))
    big = list({id(a): a for a in arrays if a.nbytes >= _PARALLEL_BYTES}.values())
    with ThreadPoolExecutor(max_workers=2) as pool:
        big_digests = dict(zip(map(id, big), pool.map(_array_digest, big)))
    for a in arrays:
        d = big_digests.get(id(a)) or _array_digest(a)
        h.update(d)
    return h.hexdigest()


def _constants(g: Graph):
    """Every constant array of `g` and of its nested bodies, in op order; an array used by
    several constants (a tied embedding) once per use."""
    for op in g.ops:
        v = op.attrs.get("value")
        if v is not None:
            yield np.asarray(v)
        for body in regions(op):
            yield from _constants(body)


def _array_digest(a: np.ndarray) -> bytes:
    """BLAKE3 (a cryptographic hash, ~4x sha256's speed here: 2.5 against 0.65 GB/s on the
    2-core Xeon VM) of the array's dtype, shape and bytes: every cached compile_lm hashes
    all of a model's weights to find its entry."""
    h = blake3.blake3(f"{a.dtype.str}:{a.shape}".encode())
    h.update(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data if a.size else b"")
    return h.digest()
