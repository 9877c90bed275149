"""tc.load: an artifact file (tercomp.runtime.artifact) -> a CompiledModule, or an
LMGenerator (or BatchedLMGenerator) when the artifact is a compiled language model (tc.compile_lm).

    >>> exe = tc.load("mlp.tcm")                      # first device the artifact runs on
    >>> exe = tc.load("mlp.tcm", device="local-task", threads=4)
"""
from __future__ import annotations

import functools
import os

import iree.runtime as rt

from ..errors import ArtifactError
from . import artifact
from .batched import open_generator
from .generator import LMGenerator
from .step_abi import STEP
from .module import CompiledModule, vm_module
from .signature import Signature, declared_types


@functools.lru_cache(maxsize=1)
def _vm_instance():
    return rt.VmInstance()


def check_module(meta: dict, vmfb: bytes, name: str) -> None:
    """ArtifactError unless what `signature.json` says (`meta`) is what the compiled
    module declares: the function and its argument and result types, and for a
    language model the vocabulary, max_seq and KV cache layout (LMGenerator.module_mismatch).
    The module's own reflection is read from the vmfb (over the mapped file where it
    lies there, else a copy), without a device."""
    try:
        module = vm_module(_vm_instance(), vmfb)
    except Exception as e:
        raise ArtifactError(f"{name}: {artifact.VMFB} is not an IREE module this iree.runtime "
                            f"reads: {e}", hint="compile the model again") from None
    functions = list(module.function_names)
    lm = meta.get("lm")
    function = STEP if lm is not None else meta["signature"]["function"]
    if function not in functions:
        raise ArtifactError(f"{name}: {artifact.SIGNATURE} names the function {function!r}, but "
                            f"the module has {', '.join(f for f in functions if not f.startswith('__'))}",
                            hint="the file was modified; compile the model again")
    reflection = dict(module.lookup_function(function).reflection)
    if lm is not None:
        wrong = LMGenerator.module_mismatch(lm, reflection)
    else:
        declared = declared_types(reflection.get("iree.abi.declaration", ""))
        wrong = None
        if declared is not None:        # a module tercomp did not build may not say
            inputs, outputs = declared
            sig = Signature.from_json(meta["signature"])
            if meta.get("numerics") and outputs and len(outputs) == len(sig.outputs) + 1:
                outputs = outputs[:-1]         # check_numerics' flags, after the results
            wrong = sig.mismatch(inputs, outputs)
    if wrong is not None:
        raise ArtifactError(f"{name}: {artifact.SIGNATURE} does not describe its module: {wrong}",
                            hint="the file was modified; compile or save the model again")


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
    check_module(meta, vmfb, os.fspath(path))
    exe = from_parts(meta, vmfb, weights, device=device, threads=threads, path=os.fspath(path))
    if meta.get("lm") is not None:
        return open_generator(exe)
    return exe
