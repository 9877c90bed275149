"""The host CPU's features, which the kernel table (table.py) and the kernels tuned per
host (dense/widening_avx2.py's row block) read. Imports nothing of tercomp."""
from __future__ import annotations

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
