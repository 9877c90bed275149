"""Compile targets: tercomp target names -> IREE compiler flags.

    llvm-cpu          the host CPU      --iree-hal-target-device=local, llvm-cpu backend,
                                        --iree-llvmcpu-target-cpu=host
    llvm-cpu-generic  any x86-64 CPU    ... --iree-llvmcpu-target-cpu=generic
                                        --iree-llvmcpu-target-triple=x86_64-unknown-linux-gnu
    vulkan            Vulkan (SPIR-V)   --iree-hal-target-device=vulkan
                                        --iree-vulkan-target=<vulkan_target>
    cuda              NVIDIA (PTX)      --iree-hal-target-device=cuda
                                        --iree-cuda-target=<cuda_target>

Several targets make ONE IREE device that picks, at load time, the first target
whose driver the runtime device matches: `--iree-hal-target-device=local,vulkan`.
(Repeating the flag instead declares several devices, and the module then needs all
of them present at once: IREE 3.13 reports `HAL device __device_1 not found`.)
Such builds also need `--iree-hal-link-executables=false`, which only the
iree-compile tool takes, so they run in it (`needs_isolation`).

Every name and option is checked here before IREE sees it, against lists of values
verified to compile with IREE 3.13: in-process, IREE crashes the interpreter
(SIGSEGV) on an unknown backend, Vulkan target or CUDA product name, and an unknown
LLVM CPU aborts it.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError, UnsupportedError
from ..runtime.devices import TARGET_DRIVERS

DEFAULT_VULKAN_TARGET = "vp_android_baseline_2022"   # SPIR-V 1.3, Vulkan 1.1: most devices
DEFAULT_CUDA_TARGET = "sm_80"                        # PTX; the driver JITs it for newer GPUs
GENERIC_X86_TRIPLE = "x86_64-unknown-linux-gnu"

VULKAN_TARGETS = (
    "vp_android_baseline_2022",
    # NVIDIA
    "pascal", "volta", "turing", "ampere", "ada",
    "sm_70", "sm_75", "sm_80", "sm_86", "sm_89", "a100", "rtx4090",
    # AMD
    "rdna1", "rdna2", "rdna3", "rdna4", "cdna3", "gfx1100", "gfx942", "rx7900xtx",
    # ARM, Qualcomm
    "valhall", "valhall1", "valhall4", "mali-g715", "adreno", "adreno-740",
)
CUDA_TARGETS = (
    "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_87", "sm_89",
    "pascal", "volta", "turing", "ampere", "ada", "a100", "rtx3090ti", "rtx4090",
)
# Hopper and later: IREE 3.13 fails with "missing GPU target" (sm_90, sm_90a, sm_100)
# or crashes (hopper, h100).
CUDA_UNSUPPORTED = ("sm_90", "sm_90a", "sm_100", "sm_100a", "sm_120", "hopper", "h100",
                    "h200", "blackwell", "b200")

ALIASES = {"vulkan-spirv": "vulkan", "cpu": "llvm-cpu", "host": "llvm-cpu"}

# Flags that choose devices and targets: set through target=, vulkan_target= and
# cuda_target= (which are validated), never through extra flags=.
_RESERVED_FLAGS = ("--iree-hal-target-device", "--iree-hal-target-backends",
                   "--iree-hal-local-target-device-backends", "--iree-llvmcpu-target-cpu",
                   "--iree-llvmcpu-target-triple", "--iree-vulkan-target", "--iree-cuda-target")


# Vulkan targets without 16-bit storage (IREE 3.13's target table: `storage = b32`).
# IREE compiles their f16 tensors as if they were f32 in memory, so every f16 buffer
# (an input, a parameter, a global such as a KV cache) reads and writes wrong values:
# on lavapipe a plain f16 -> f32 cast is off by up to 50. tercomp refuses f16 there
# (lowering.check_storage); 8-bit integers are emulated correctly.
NO_16BIT_STORAGE = ("vp_android_baseline_2022",)
#: Vulkan targets that store f16, for the error's hint
WITH_16BIT_STORAGE = ("valhall", "adreno", "ampere", "rdna3")


@dataclass(frozen=True)
class Target:
    name: str          # tercomp target name
    device: str        # IREE target-device alias
    flags: tuple       # backend flags (global to the compile)
    arch: str = ""     # the Vulkan or CUDA target (vulkan_target=, cuda_target=)

    @property
    def stores_16bit(self) -> bool:
        """Whether f16/bf16 tensors can live in this target's buffers."""
        return self.arch not in NO_16BIT_STORAGE

    @property
    def drivers(self) -> tuple:
        """Runtime HAL drivers that run this target's code, preferred first."""
        return TARGET_DRIVERS[self.name]


def _cpu(name: str, cpu: str, triple: str | None = None) -> Target:
    flags = ["--iree-hal-local-target-device-backends=llvm-cpu", f"--iree-llvmcpu-target-cpu={cpu}"]
    if triple:
        flags.append(f"--iree-llvmcpu-target-triple={triple}")
    return Target(name, "local", tuple(flags))


def _vulkan(vulkan_target: str | None) -> Target:
    vt = vulkan_target or DEFAULT_VULKAN_TARGET
    if vt not in VULKAN_TARGETS:
        raise ConfigError(f"unknown Vulkan target {vt!r}",
                          hint=f"use one of {', '.join(VULKAN_TARGETS)} (default "
                               f"{DEFAULT_VULKAN_TARGET}, which runs on most Vulkan 1.1 devices)")
    return Target("vulkan", "vulkan", (f"--iree-vulkan-target={vt}",), vt)


def _cuda(cuda_target: str | None) -> Target:
    ct = cuda_target or DEFAULT_CUDA_TARGET
    if ct.lower() in CUDA_UNSUPPORTED:
        raise UnsupportedError(f"IREE 3.13 cannot build CUDA code for {ct} (Hopper and newer)",
                               hint=f"use cuda_target='{DEFAULT_CUDA_TARGET}': its PTX is compiled "
                                    "by the CUDA driver for newer GPUs, H100 included")
    if ct not in CUDA_TARGETS:
        raise ConfigError(f"unknown CUDA target {ct!r}", hint=f"use one of {', '.join(CUDA_TARGETS)}")
    return Target("cuda", "cuda", (f"--iree-cuda-target={ct}",), ct)


def target_names(target) -> list:
    """Normalize `target` (a name or a list of names) to a list of canonical names."""
    names = [target] if isinstance(target, str) else list(target) if isinstance(target, (list, tuple)) else None
    if not names or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"target must be a name or a list of names, got {target!r}",
                          hint=f"use one of {', '.join(TARGET_DRIVERS)}")
    out = []
    for n in names:
        canon = ALIASES.get(n, n)
        if canon not in TARGET_DRIVERS:
            raise ConfigError(f"unknown target {n!r}", hint=f"use one of {', '.join(TARGET_DRIVERS)}")
        if canon not in out:
            out.append(canon)
    if "llvm-cpu" in out and "llvm-cpu-generic" in out:
        raise ConfigError("targets llvm-cpu and llvm-cpu-generic cannot share one artifact "
                          "(both are the local CPU device)", hint="pick one of them")
    return out


def resolve_targets(target="llvm-cpu", *, vulkan_target: str | None = None,
                    cuda_target: str | None = None) -> list:
    """The Target of each name in `target`, options checked."""
    names = target_names(target)
    if vulkan_target is not None and "vulkan" not in names:
        raise ConfigError(f"vulkan_target={vulkan_target!r} was given but the targets are "
                          f"{', '.join(names)}", hint="add 'vulkan' to target=")
    if cuda_target is not None and "cuda" not in names:
        raise ConfigError(f"cuda_target={cuda_target!r} was given but the targets are "
                          f"{', '.join(names)}", hint="add 'cuda' to target=")
    make = {
        "llvm-cpu": lambda: _cpu("llvm-cpu", "host"),
        "llvm-cpu-generic": lambda: _cpu("llvm-cpu-generic", "generic", GENERIC_X86_TRIPLE),
        "vulkan": lambda: _vulkan(vulkan_target),
        "cuda": lambda: _cuda(cuda_target),
    }
    return [make[n]() for n in names]


def check_extra_flags(flags) -> list:
    """User-given extra IREE flags, refused when they would pick devices or targets."""
    flags = list(flags)
    for f in flags:
        if not isinstance(f, str) or not f.startswith("-"):
            raise ConfigError(f"extra IREE flags must be strings like '--iree-...', got {f!r}")
        name = "--" + f.lstrip("-").split("=")[0]
        if name in _RESERVED_FLAGS or name.startswith("--iree-vulkan-target-features"):
            raise ConfigError(f"the flag {f} is set by tercomp from the target",
                              hint="use target=, vulkan_target= or cuda_target= instead")
    return flags


# IREE 3.13 links the executables of a device with several targets wrongly: the CPU
# linker gathers the dispatches into one `__linked` executable and the other targets'
# variants are lost, so with more than one dispatch the module does not load on the
# GPU ("does not support any variant of executable"). Unlinked executables are right.
# The switch is a global option of the iree-compile tool, not a session flag (set
# in-process it can be set once per process and then holds for every compile).
UNLINKED = "--iree-hal-link-executables=false"
_TOOL_ONLY = (UNLINKED,)


def target_flags(target="llvm-cpu", **options) -> list:
    """All IREE flags for `target` (a name or list of names).

    >>> target_flags(["llvm-cpu", "vulkan"])[:2]
    ['--iree-hal-target-device=local,vulkan', '--iree-hal-link-executables=false']
    """
    targets = resolve_targets(target, **options)
    devices = ",".join(t.device for t in targets)
    flags = [f"--iree-hal-target-device={devices}"] + ([UNLINKED] if len(targets) > 1 else [])
    return flags + [f for t in targets for f in t.flags]


def needs_tool(flags) -> bool:
    """Whether `flags` include options that only the iree-compile tool takes."""
    return any(f in _TOOL_ONLY for f in flags)


# Targets whose in-process compile has crashed the interpreter with IREE 3.13 (a
# SIGSEGV in the CUDA/SPIR-V backends, e.g. compile_lm for cuda): by default they
# compile in an iree-compile subprocess, where a crash is a CompileError.
ISOLATED_BY_DEFAULT = ("vulkan", "cuda")


def needs_isolation(target_names, flags, user_flags=(), isolate: bool | None = None) -> bool:
    """Whether a compile runs IREE in a subprocess (iree_session.compile_vmfb).

    Always for extra user flags (LLVM's option parser ends the process on some bad
    values) and for options only the iree-compile tool takes; else `isolate`, where
    None (the default) isolates the targets in ISOLATED_BY_DEFAULT.

    >>> needs_isolation(["llvm-cpu"], []), needs_isolation(["llvm-cpu", "cuda"], [])
    (False, True)
    """
    if user_flags or needs_tool(flags):
        return True
    if isolate is None:
        return any(n in ISOLATED_BY_DEFAULT for n in target_names)
    return bool(isolate)
