"""IREE target flags per tercomp target name. Names are validated here because an
unknown backend name given to IREE in-process can crash the interpreter."""
from __future__ import annotations

from ..errors import TercompError
from .iree_session import HOST_CPU_FLAGS

TARGETS = {
    "llvm-cpu": list(HOST_CPU_FLAGS),
}


def target_flags(target: str) -> list:
    if target not in TARGETS:
        raise TercompError(f"unknown target {target!r}", hint=f"use one of {', '.join(TARGETS)}")
    return list(TARGETS[target])
