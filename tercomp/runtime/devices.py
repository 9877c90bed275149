"""Devices: which IREE HAL drivers and devices this process has, and opening them.

Devices are HAL driver names or IREE device URIs: "local-task" (a thread pool),
"local-sync" (the calling thread), "vulkan", "cuda"; "vulkan://<path>" picks one of
several (paths as `iree-run-module --list_devices` prints them). The local-task pool
size is `threads=N` or "local-task?threads=N". A device that is not present is a
DeviceUnavailable naming the drivers that are.

    >>> available_drivers()                     # e.g. ['local-task', 'local-sync', 'vulkan']
    >>> pick_device(["llvm-cpu"])               # the first present driver for a target
    'local-task'
    >>> open_device("local-task?threads=4").device   # the iree.runtime HalDevice
"""
from __future__ import annotations

import contextlib
import os
import weakref
import warnings

import iree.runtime as rt
from iree.runtime import flags as rt_flags
from iree.runtime import system_setup

from ..errors import ConfigError, DeviceUnavailable

# Which HAL drivers run the code of each tercomp target, preferred first.
TARGET_DRIVERS = {
    "llvm-cpu": ("local-task", "local-sync"),
    "llvm-cpu-generic": ("local-task", "local-sync"),
    "vulkan": ("vulkan",),
    "cuda": ("cuda",),
}
KNOWN_DRIVERS = ("local-task", "local-sync", "vulkan", "cuda")

_present: dict = {}          # driver -> whether a device of it exists (probed once)
_task_threads: list = []     # [n] once the local-task pool exists (n None: IREE's default)

# Bytes of "local memory" IREE's task executor gives each worker for dispatches that
# declare some (GPU-style workgroup memory). IREE's default is 2 MiB a worker, allocated
# and zeroed when the pool is made: 4 MiB of a 2-worker process's resident memory, 32 MiB
# at 16 workers. llvm-cpu code keeps its tiles on the worker's stack and declares none
# (tercomp's dispatches, the ternary kernels included, run with 4 KiB); a dispatch that
# needs more fails loudly ("dispatch requires N b of local memory"), it is not wrong.
# TERCOMP_TASK_LOCAL_MEMORY overrides it (bytes; 0: IREE's default).
TASK_WORKER_LOCAL_MEMORY = 64 * 1024


def driver_present(driver: str) -> bool:
    """Whether this process can open a device of `driver` (the driver is compiled into
    iree.runtime AND a device exists: the CUDA driver is built in everywhere, but needs
    libcuda and a GPU)."""
    if driver not in _present:
        ok = driver in rt.query_available_drivers()
        if ok and driver not in ("local-task", "local-sync"):
            try:
                ok = bool(rt.get_driver(driver).query_available_devices())
            except Exception:
                ok = False
        _present[driver] = ok
    return _present[driver]


def available_drivers() -> list:
    """The drivers of KNOWN_DRIVERS with a device present, e.g. ['local-task', 'local-sync']."""
    return [d for d in KNOWN_DRIVERS if driver_present(d)]


def parse_device(device: str, threads: int | None = None) -> tuple:
    """'local-task?threads=2' -> ('local-task', 'local-task', 2): (driver, IREE URI,
    thread count). `threads=` and a ?threads= in the name must agree."""
    if not isinstance(device, str) or not device:
        raise DeviceUnavailable(f"device must be a driver name such as 'local-task', got {device!r}")
    uri, _, query = device.partition("?")
    driver = uri.split("://")[0]
    if driver not in KNOWN_DRIVERS:
        raise DeviceUnavailable(f"unknown device {device!r}",
                                hint=f"use one of {', '.join(KNOWN_DRIVERS)}; present here: "
                                     f"{', '.join(available_drivers())}")
    for item in filter(None, query.split("&")):
        key, _, value = item.partition("=")
        if key != "threads" or not value.isdigit():
            raise DeviceUnavailable(f"device {device!r}: unknown option {item!r}",
                                    hint="the only device option is ?threads=N (local-task)")
        if threads is not None and threads != int(value):
            raise DeviceUnavailable(f"device {device!r} and threads={threads} disagree")
        threads = int(value)
    if threads is not None:
        if not isinstance(threads, int) or isinstance(threads, bool):
            raise DeviceUnavailable(f"threads must be an int, got {threads!r}")
        if driver != "local-task":
            raise DeviceUnavailable(f"threads= applies to the local-task device, not {driver}")
        if threads < 1:
            raise DeviceUnavailable(f"threads must be at least 1, got {threads}")
    return driver, uri, threads


def _configure_task_threads(threads: int | None):
    # IREE sizes the local-task pool from process-wide flags once, when the driver is
    # first created (iree_task_executors_create_from_flags); later flags have no effect.
    if not _task_threads and threads is not None and any(
            uri.startswith("local-task") for uri in getattr(system_setup, "_GLOBAL_DEVICES_BY_URI", {})):
        _task_threads.append(None)         # someone else's iree.runtime code made the pool
    if not _task_threads:
        local = _local_memory()
        rt_flags.parse_flags(f"--task_topology_group_count={threads or 0}",
                             *([f"--task_worker_local_memory={local}"] if local else []))
        _task_threads.append(threads)
    elif threads is not None and _task_threads[0] != threads:
        have = _task_threads[0] or "IREE's default number of"
        raise ConfigError(f"the local-task thread pool of this process already has {have} "
                          f"threads; IREE sizes it once per process, so threads={threads} "
                          "cannot take effect",
                          hint="pass threads= to the first compile or load of the process")


def _local_memory() -> int:
    value = os.environ.get("TERCOMP_TASK_LOCAL_MEMORY", "").strip()
    if not value:
        return TASK_WORKER_LOCAL_MEMORY
    if not value.isdigit():
        raise ConfigError(f"TERCOMP_TASK_LOCAL_MEMORY={value!r} is not a number of bytes",
                          hint="unset it, or give bytes of local memory per worker (0: IREE's default)")
    return int(value)


class HeldDevice:
    """A GPU device this process opened itself: shared per URI by the modules that hold
    it, closed when the last of them is gone. iree.runtime's own `get_device` keeps every
    device for the life of the process, and Mesa 22.3's lavapipe polls its semaphores
    from two threads for as long as a device is open: measured, a process that had run
    one Vulkan module then burned two cores while idle (20 s of CPU in 10 s of sleep),
    0 once the device is closed."""
    __slots__ = ("device", "__weakref__")

    def __init__(self, device):
        self.device = device


_held: "weakref.WeakValueDictionary[str, HeldDevice]" = weakref.WeakValueDictionary()


def open_device(device: str, threads: int | None = None) -> HeldDevice:
    """The device for `device`: a `HeldDevice` whose `.device` is the iree.runtime
    HalDevice. The CPU drivers' devices are iree.runtime's process-wide ones (the
    local-task pool is sized once per process); a GPU's is shared per URI while some
    holder of the returned object lives, and closed after."""
    driver, uri, threads = parse_device(device, threads)
    if not driver_present(driver):
        raise DeviceUnavailable(f"device {device!r} is not available on this machine",
                                hint=f"available drivers: {', '.join(available_drivers())}")
    if driver == "local-task":
        _configure_task_threads(threads)
    try:
        with _mpi_launch_hidden():
            if driver in ("local-task", "local-sync"):
                return HeldDevice(rt.get_device(uri))
            held = _held.get(uri)
            if held is None:
                held = _held[uri] = HeldDevice(rt.get_driver(driver).create_device_by_uri(uri))
            return held
    except Exception as e:
        raise DeviceUnavailable(f"device {device!r} could not be opened: {e}",
                                hint=f"available drivers: {', '.join(available_drivers())}") from None


# IREE gives a device an MPI channel provider (for its own collectives) when one of these
# is set, as mpiexec sets them, and then fails to open it unless it finds libmpi.so
# (iree/hal/utils/mpi_channel_provider.c, iree_hal_mpi_is_configured). tercomp's
# collectives go through mpi4py (tercomp.distributed), so IREE is not told of the job.
_MPI_LAUNCH_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPIEXEC_HOSTNAME")


@contextlib.contextmanager
def _mpi_launch_hidden():
    saved = {k: os.environ.pop(k) for k in _MPI_LAUNCH_VARS if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def pick_device(targets, device: str | None = None) -> str | None:
    """Check that `device` runs code built for `targets`, or, with device=None, pick the
    first present driver that does (None when none is present: calls will fail)."""
    drivers = [d for t in targets for d in TARGET_DRIVERS.get(t, ())]
    if device is not None:
        driver = parse_device(device)[0]
        if driver not in drivers:
            raise DeviceUnavailable(f"the module was compiled for {', '.join(targets)}, which "
                                    f"does not run on {driver}",
                                    hint=f"use device= one of {', '.join(dict.fromkeys(drivers))}, "
                                         "or compile for a target that runs there")
        return device
    return next((d for d in drivers if driver_present(d)), None)


def check_threads(targets, device: str | None, threads: int | None) -> None:
    """threads= needs the local-task device (given, or the first for `targets`)."""
    if threads is not None:
        driver = parse_device(device)[0] if device else TARGET_DRIVERS.get(targets[0], ("?",))[0]
        parse_device(driver, threads)


def warn_if_lavapipe_mismatch(device: str, flags) -> None:
    # Measured with Mesa 22.3 lavapipe: code built for GPU targets (ampere, rdna3,
    # valhall) runs there but returns wrong numbers, silently; the baseline profile's
    # code is exact. IREE does not check a module's target against the device.
    target = next((f.split("=", 1)[1] for f in flags if f.startswith("--iree-vulkan-target=")), None)
    if parse_device(device)[0] != "vulkan" or target in (None, "vp_android_baseline_2022"):
        return
    names = [d.get("name", "") for d in rt.get_driver("vulkan").query_available_devices()]
    if any("llvmpipe" in n for n in names):
        warnings.warn(f"this module was compiled for the Vulkan target {target!r}, but the device "
                      "is Mesa's lavapipe (a CPU), which computes wrong results for GPU targets; "
                      "compile with the default vulkan_target", stacklevel=4)
