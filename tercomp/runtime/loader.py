"""tc.load: an artifact file (tercomp.runtime.artifact) -> a CompiledModule, or an
LMGenerator (or BatchedLMGenerator) when the artifact is a compiled language model (tc.compile_lm).

    >>> exe = tc.load("mlp.tcm")                      # first device the artifact runs on
    >>> exe = tc.load("mlp.tcm", device="local-task", threads=4)
"""
from __future__ import annotations

import os

from . import artifact
from .batched import open_generator
from .module import CompiledModule
from .signature import Signature


def from_parts(meta: dict, vmfb: bytes, weights, device=None, threads=None, **extra):
    """A CompiledModule from artifact.read_bytes() parts."""
    info = {k: meta.get(k) for k in ("flags", "drivers", "tercomp_version", "iree_version",
                                     "content_hash", "lm", "numerics", "ternary")}
    info.update(extra)
    return CompiledModule(vmfb, Signature.from_json(meta["signature"]), device=device,
                          targets=meta.get("targets") or ["llvm-cpu"], meta=info,
                          weights=weights, weights_scope=meta.get("weights_scope", "model"),
                          threads=threads)


def load(path: str, device: str | None = None, threads: int | None = None):
    """Load an artifact written by `exe.save(path)`.

    An artifact is executable code (compiled machine code runs when it is called): load
    only files you trust. Its sha256 digests catch damage, not tampering. Only regular
    files up to $TERCOMP_MAX_FILE_BYTES (16 GiB) are read.

    With device=None, the first device present that the artifact supports (llvm-cpu: local-task, vulkan: vulkan, cuda:
    cuda, in the artifact's target order); `threads` sizes the local-task pool.

    >>> exe = tc.load("mlp.tcm")
    >>> y = exe(x)
    """
    meta, vmfb, weights = artifact.read(path)
    exe = from_parts(meta, vmfb, weights, device=device, threads=threads, path=os.fspath(path))
    if meta.get("lm") is not None:
        return open_generator(exe)
    return exe
