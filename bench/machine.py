"""What a bench run ran on: the CPU (name, the SIMD features tercomp's kernels choose
by, cores) and how busy the machine was. Every bench prints it beside its figures: a
kernel claim names the CPU it was measured on."""
from __future__ import annotations

import os
import platform

FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")


def cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read().splitlines()
    except OSError:
        return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    name = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), "?")
    flags = set(next((ln.split(":", 1)[1].split() for ln in info if ln.startswith("flags")), []))
    have = [f for f in FEATURES if f in flags]
    return f"{name} ({', '.join(have) or 'no AVX2'}), {os.cpu_count()} cores"


def load() -> str:
    try:
        return f"load average {os.getloadavg()[0]:.2f}"
    except OSError:
        return "load average unknown"
