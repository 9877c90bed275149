"""The host CPU's features, which the kernel table (table.py) and the kernels tuned per
host (dense/widening_avx2.py's row block) read. Imports nothing of tercomp."""
from __future__ import annotations

import ctypes
import functools


@functools.lru_cache(maxsize=1)
def host_cpu_features() -> frozenset:
    """The host CPU's feature flags as Linux names them (/proc/cpuinfo), empty elsewhere:
    what `--iree-llvmcpu-target-cpu=host` compiles for."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


#: The host features AMX tiles of int8 need.
AMX_FEATURES = ("amx_int8", "amx_tile")
_ARCH_PRCTL = 158             # the x86-64 syscall number
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


@functools.lru_cache(maxsize=1)
def enable_amx() -> bool:
    """Ask Linux for this process's permission to use AMX tile data, once (without it a
    process's first tile instruction is a SIGILL: arch_prctl(ARCH_REQ_XCOMP_PERM,
    XFEATURE_XTILEDATA), Linux 5.16 and later). True where the host has AMX-INT8 and the
    permission was granted. The kernel table offers the amx kernel only then, and the
    kernel's emitter calls it; a module with the kernel asks again in its own quantize
    dispatch (templates/amx_lib.mlir `permit`), so any process runs it (tercomp's
    runtime, which imports no compiler side, and IREE's tools alike)."""
    if not all(f in host_cpu_features() for f in AMX_FEATURES):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False
