"""The compile cache: compiled modules keyed by a hash of everything that determines them.

tc.compile hashes the MLIR module printed in full (large constants included), the
IREE flags, the tercomp version and the IREE compiler version (see `key`); an entry
is an artifact file `<key>.tcm` that records its key (an entry whose key differs, such as another model's artifact copied in, is a miss) (tercomp.runtime.artifact) in $TERCOMP_CACHE_DIR,
default `~/.cache/tercomp`. Entries are written atomically (a temp file, then
os.replace), so concurrent compiles never see half a file, and a damaged entry is
treated as a miss and rewritten. Delete the directory to clear the cache; nothing
else evicts entries.
"""
from __future__ import annotations

import hashlib
import os
import warnings

from ..errors import ArtifactError, TercompError
from . import artifact
from .files import cache_dir


def key(*parts) -> str:
    """sha256 over `parts` (str or bytes), each length-prefixed so that no two
    different part lists collide by concatenation."""
    h = hashlib.sha256()
    for p in parts:
        data = p if isinstance(p, bytes) else str(p).encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def entry_path(k: str) -> str:
    return os.path.join(cache_dir(), f"{k}.tcm")


def lookup(k: str):
    """(meta, vmfb, weights) of entry `k`, or None on a miss."""
    path = entry_path(k)
    if not os.path.exists(path):
        return None
    try:
        found = artifact.read(path)
    except ArtifactError:
        return None          # damaged or from another IREE: recompile and overwrite
    if found[0].get("cache_key") != k:
        return None          # another module's artifact under this name: not a hit
    return found


def store(k: str, exe) -> None:
    """Write CompiledModule `exe` as entry `k`; a cache that cannot be written only warns."""
    try:
        # synced before it is moved into place, then stamped as verified: the next
        # compile of the same program (a hit) maps it without hashing its weights again
        # (0.3 s for a 700M model); a crash leaves the old entry or the whole new one
        artifact.write(exe, entry_path(k), "compile cache entry", ArtifactError, make_dirs=True)
        artifact.mark_verified(entry_path(k))
    except TercompError as e:
        warnings.warn(f"tercomp: cannot write the compile cache {cache_dir()}: {e}", stacklevel=3)
