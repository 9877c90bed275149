"""CompiledModule: a .vmfb loaded into iree-runtime, called with NumPy arrays.

This package imports only iree.runtime, NumPy and tercomp.ir's type table, never the
compiler (tercomp.codegen, iree.compiler), so a saved artifact runs where only
iree-base-runtime is installed.

Devices are HAL driver names or IREE device URIs: "local-task" (a thread pool),
"local-sync" (the calling thread), "vulkan", "cuda"; "vulkan://<path>" picks one of
several (paths as `iree-run-module --list_devices` prints them). The local-task pool
size is `threads=N` or "local-task?threads=N".
"""
from __future__ import annotations

import mmap
import warnings

import numpy as np

from ..errors import DeviceUnavailable, InputError, TercompError
from .numerics import report as report_numerics
from .. import dimexpr, pytree
from .signature import Signature

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


def driver_present(driver: str) -> bool:
    """Whether this process can open a device of `driver` (the driver is compiled into
    iree.runtime AND a device exists: the CUDA driver is built in everywhere, but needs
    libcuda and a GPU)."""
    if driver not in _present:
        import iree.runtime as rt
        ok = driver in rt.query_available_drivers()
        if ok and driver not in ("local-task", "local-sync"):
            try:
                ok = bool(rt.get_driver(driver).query_available_devices())
            except Exception:
                ok = False
        _present[driver] = ok
    return _present[driver]


def available_drivers() -> list:
    """The drivers of KNOWN_DRIVERS with a device present, e.g. ['local-sync', 'local-task']."""
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
    import iree.runtime as rt
    import iree.runtime.flags  # noqa: F401
    from iree.runtime import system_setup
    if not _task_threads and threads is not None and any(
            uri.startswith("local-task") for uri in getattr(system_setup, "_GLOBAL_DEVICES_BY_URI", {})):
        _task_threads.append(None)         # someone else's iree.runtime code made the pool
    if not _task_threads:
        rt.flags.parse_flags(f"--task_topology_group_count={threads or 0}")
        _task_threads.append(threads)
    elif threads is not None and _task_threads[0] != threads:
        have = _task_threads[0] or "IREE's default number of"
        raise TercompError(f"the local-task thread pool of this process already has {have} "
                           f"threads; IREE sizes it once per process, so threads={threads} "
                           "cannot take effect",
                           hint="pass threads= to the first compile or load of the process")


def open_device(device: str, threads: int | None = None):
    """The iree.runtime HalDevice for `device` (shared per URI within the process)."""
    import iree.runtime as rt
    driver, uri, threads = parse_device(device, threads)
    if not driver_present(driver):
        raise DeviceUnavailable(f"device {device!r} is not available on this machine",
                                hint=f"available drivers: {', '.join(available_drivers())}")
    if driver == "local-task":
        _configure_task_threads(threads)
    try:
        return rt.get_device(uri)
    except Exception as e:
        raise DeviceUnavailable(f"device {device!r} could not be opened: {e}",
                                hint=f"available drivers: {', '.join(available_drivers())}") from None


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


def _warn_if_lavapipe_mismatch(device: str, flags) -> None:
    # Measured with Mesa 22.3 lavapipe: code built for GPU targets (ampere, rdna3,
    # valhall) runs there but returns wrong numbers, silently; the baseline profile's
    # code is exact. IREE does not check a module's target against the device.
    target = next((f.split("=", 1)[1] for f in flags if f.startswith("--iree-vulkan-target=")), None)
    if parse_device(device)[0] != "vulkan" or target in (None, "vp_android_baseline_2022"):
        return
    import iree.runtime as rt
    names = [d.get("name", "") for d in rt.get_driver("vulkan").query_available_devices()]
    if any("llvmpipe" in n for n in names):
        warnings.warn(f"this module was compiled for the Vulkan target {target!r}, but the device "
                      "is Mesa's lavapipe (a CPU), which computes wrong results for GPU targets; "
                      "compile with the default vulkan_target", stacklevel=4)


def _flat(in_tree) -> bool:
    """Whether the arguments are the input arrays themselves (no nested pytree)."""
    return in_tree is None or (in_tree[0] == "tuple" and not any(in_tree[1]))


def _plain_arrays_key(args) -> tuple | None:
    """(shape, dtype) of each argument when all are C-contiguous NumPy arrays, else None."""
    key = []
    for a in args:
        if type(a) is not np.ndarray or not a.flags.c_contiguous:
            return None
        key.append((a.shape, a.dtype))
    return tuple(key)


def _page_aligned(data) -> mmap.mmap:
    """`data` (bytes-like) in anonymous, page-aligned memory."""
    if isinstance(data, mmap.mmap):
        return data
    mem = mmap.mmap(-1, len(data))
    mem[:] = data
    return mem


def _to_host(arr, host_memory: bool = False) -> np.ndarray:
    """Copy an iree.runtime DeviceArray to a NumPy array (`host_memory`: the caller
    knows it is mappable, as every buffer of a local-task/local-sync device is; asking
    the buffer costs microseconds a call)."""
    import iree.runtime as rt
    if host_memory or arr._is_mappable():
        return np.array(arr.to_host())
    # DeviceArray.to_host() imports an unaligned np.empty into Vulkan, which drivers
    # that require 4096-byte host-pointer alignment (lavapipe) reject; a mappable
    # staging buffer works everywhere. (_buffer_view/_device: iree.runtime 3.13 internals.)
    view, dev = arr._buffer_view, arr._device
    src = view.get_buffer()
    raw = rt.HalElementType.map_to_dtype(view.element_type)
    if src.byte_length() == 0:
        return np.empty(view.shape, raw)
    staging = dev.allocator.allocate_buffer(
        memory_type=int(rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE),
        allowed_usage=int(rt.BufferUsage.TRANSFER_TARGET | rt.BufferUsage.MAPPING_SCOPED),
        allocation_size=src.byte_length())
    sem = dev.create_semaphore(0)
    dev.queue_copy(src, staging, wait_semaphores=rt.HalFence.create_at(sem, 0),
                   signal_semaphores=rt.HalFence.create_at(sem, 1))
    rt.HalFence.create_at(sem, 1).wait()
    return np.array(staging.map().asarray(view.shape, raw))


class DeviceArray:
    """A result left on its device by `exe(..., keep_on_device=True)`. Pass it back to a
    compiled module on the same device without a copy; `np.asarray(a)` or
    `a.to_host()` copies it to the host.

    >>> h = exe(x, keep_on_device=True)
    >>> y = exe(h)                      # no host round trip
    """

    def __init__(self, array, device: str, dtype: np.dtype):
        self._array = array        # the iree.runtime DeviceArray
        self.device = device
        self.dtype = np.dtype(dtype)
        self.shape = tuple(array._buffer_view.shape)

    def to_host(self) -> np.ndarray:
        out = _to_host(self._array)
        return out.astype(self.dtype) if out.dtype != self.dtype else out

    def __array__(self, dtype=None, copy=None):
        out = self.to_host()
        return out if dtype is None else out.astype(dtype)

    def __repr__(self):
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype.name}, device={self.device!r})"


class CompiledModule:
    """A compiled function. `exe(*args)` takes the same pytree of arrays as the traced
    example arguments and returns the same pytree of results, as NumPy arrays (or, with
    keep_on_device=True, as DeviceArrays that can be passed back in).

    >>> exe = tc.compile(model, tc.spec(("B", 784)))
    >>> logits = exe(x)                # any batch size
    >>> print(exe.ir("mlir"))         # the linalg module
    >>> exe.save("model.tcm")         # see tercomp.runtime.artifact

    `device` is picked from `targets` when None (llvm-cpu: local-task, vulkan: vulkan,
    cuda: cuda; the first present). `weights` are the bytes of an .irpa archive whose
    parameters (scope `weights_scope`) the module reads.
    """

    def __init__(self, vmfb: bytes, signature: Signature, stages: dict | None = None,
                 device: str | None = None, targets=("llvm-cpu",), meta: dict | None = None,
                 weights: bytes | None = None, weights_scope: str = "model",
                 threads: int | None = None):
        self.vmfb = vmfb
        self.signature = signature
        self.stages = stages or {}
        self.targets = list(targets)
        self.meta = meta or {}
        self.weights = weights
        self.weights_scope = weights_scope
        self.device = pick_device(self.targets, device)
        check_threads(self.targets, self.device, threads)     # fail early, not at the call
        self.threads = threads
        self._fn = None
        self._checked = None

    def _load(self):
        if self._fn is None:
            import iree.runtime as rt
            if self.device is None:
                wanted = [d for t in self.targets for d in TARGET_DRIVERS.get(t, ())]
                raise DeviceUnavailable(
                    f"no device here runs this module (compiled for {', '.join(self.targets)}, "
                    f"which needs {' or '.join(dict.fromkeys(wanted))})",
                    hint=f"available drivers: {', '.join(available_drivers())}")
            hal_device = open_device(self.device, self.threads)
            _warn_if_lavapipe_mismatch(self.device, self.meta.get("flags", ()))
            config = rt.Config(device=hal_device)
            ctx = rt.SystemContext(config=config)
            try:
                if self._weights is not None:
                    # IREE binds parameters in place when their memory is aligned and
                    # copies them otherwise (a bytes object's data is not): moved once to
                    # page-aligned memory, the weights exist once in RAM. Measured, 16
                    # ternary 4096x4096 layers (64 MiB): +133 -> +69 MiB after load.
                    self._weights = _page_aligned(self._weights)
                    index = rt.ParameterIndex()
                    index.load_from_file_handle(rt.FileHandle.wrap_memory(self._weights), "irpa")
                    provider = index.create_provider(scope=self.weights_scope)
                    ctx.add_vm_module(rt.create_io_parameters_module(ctx.instance, provider))
                ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, self.vmfb))
                fn = ctx.modules.module[self.signature.function]
            except Exception as e:
                raise DeviceUnavailable(f"the module does not load on {self.device}: {e}",
                                        hint=f"it was compiled for {', '.join(self.targets)}") from None
            self._ctx, self._hal_device, self._fn = ctx, hal_device, fn
        return self._fn

    def __repr__(self):
        sig = self.signature
        ins = ", ".join(t.describe() for t in sig.inputs)
        outs = ", ".join(t.describe() for t in sig.outputs)
        extra = [f"targets={','.join(self.targets)}", f"device={self.device}"]
        if self.meta.get("ternary"):
            extra.append(f"ternary={','.join(self.meta['ternary'])}")
        if self._weights is not None:
            extra.append(f"weights={len(self._weights) / 2**20:.1f} MiB")
        return f"<CompiledModule {sig.function}({ins}) -> ({outs}); {'; '.join(extra)}>"

    @property
    def weights(self) -> bytes | None:
        """The .irpa archive of the module's parameters (None without parameters)."""
        w = self._weights
        return bytes(w) if isinstance(w, mmap.mmap) else w

    @weights.setter
    def weights(self, value):
        self._weights = value

    def function(self, name: str):
        """The iree.runtime function `name` of the loaded module, called with NumPy arrays
        and returning iree.runtime DeviceArrays, unchecked. Every function of one module
        shares its loaded state (weights, mutable globals such as a KV cache)."""
        self._load()
        try:
            return self._ctx.modules.module[name]
        except (KeyError, AttributeError):
            raise TercompError(f"the module has no function {name!r}") from None

    def _device_input(self, x):
        # A DeviceArray of this module's device goes in as is; any other is copied.
        if isinstance(x, DeviceArray):
            return x._array if x._array._device is self._hal_device else x.to_host()
        return x

    def __call__(self, *args, keep_on_device: bool = False):
        sig = self.signature
        # Inputs of the same shapes and dtypes as the last call that passed the checks
        # pass them again: skip to the invoke (the per-call overhead budget is 15 us).
        key = _plain_arrays_key(args) if _flat(sig.in_tree) else None
        if key is not None and key == self._checked:
            arrays = args
            fn = self._fn
        else:
            arrays = sig.leaves(args)
            fn = self._load()
            arrays = [self._device_input(a) for a in arrays]
            self._checked = key
        try:
            res = fn(*arrays)
        except Exception as e:
            raise TercompError(f"the IREE runtime failed running {sig.function} on "
                               f"{self.device}: {e}") from None
        res = list(res) if isinstance(res, (list, tuple)) else [res]
        if self.meta.get("numerics"):
            report_numerics(_to_host(res.pop()), self.meta["numerics"])
        out = []
        for r, s in zip(res, sig.outputs):
            if keep_on_device:
                out.append(DeviceArray(r, self.device, np.bool_ if s.dtype == "i1" else r.dtype))
            else:   # _to_host gives the buffer's own dtype; i1 comes back as i8
                h = _to_host(r, self.device in ("local-task", "local-sync"))
                out.append(h.astype(np.bool_, copy=False) if s.dtype == "i1" else h)
        if sig.out_tree is None:
            return out[0] if len(out) == 1 else tuple(out)
        return pytree.unflatten(sig.out_tree, out)

    def save(self, path: str) -> None:
        """Write the module to `path` as ONE file, a zip archive (stored, not compressed) of
        `module.vmfb` (the IREE module), `signature.json` (input and output names, shapes
        with symbolic dims as strings, dtypes, pytree structure, targets and drivers, IREE
        flags, tercomp and IREE versions, and the sha256 of every other member) and, when
        the module reads parameters, `weights.irpa`. `tc.load(path)` checks it all; the
        full description is in tercomp.runtime.artifact.

        >>> exe.save("mlp.tcm")
        >>> tc.load("mlp.tcm", device="local-task")(x)
        """
        from .artifact import save
        save(self, path)

    def ir(self, stage: str) -> str:
        """The text of one compile stage: 'tern', a pass name ('simplify', 'autodiff',
        'ternary'), 'mlir', or an IREE phase (when compiled with dump_dir)."""
        if stage in self.stages:
            return self.stages[stage]
        raise TercompError(f"no stage {stage!r} was recorded",
                           hint=f"recorded stages: {', '.join(self.stages) or 'none'}; IREE "
                                "phases are kept when compiling with dump_dir= or TERCOMP_DUMP=dir")

    def memory_report(self, **dims) -> dict:
        """What the compiled backward keeps from its forward (activations, and the stacked
        per-step residuals of every tc.scan): {"saved_bytes": total, "saved": [{"name",
        "shape", "dtype", "bytes"}]}. Symbolic sizes are bound by `dims` (T=1024); an
        unbound one leaves the bytes as None. tc.checkpoint shrinks it.

        >>> exe.memory_report(T=1024)["saved_bytes"]
        """
        rows, total = [], 0
        for name, shape, dtype in self.meta.get("saved_for_backward", []):
            try:
                n = int(np.prod([d if isinstance(d, int) else dimexpr.evaluate(dimexpr.parse(d), dims)
                                 for d in shape], dtype=np.int64))
                size = n * max(1, int(dtype[1:]) // 8)         # "f32" -> 4 bytes, "i1" -> 1
            except (KeyError, ValueError, TercompError):
                size = None
            rows.append({"name": name, "shape": list(shape), "dtype": dtype, "bytes": size})
            total = None if total is None or size is None else total + size
        return {"saved_bytes": total, "saved": rows}

    @property
    def vmfb_size(self) -> int:
        return len(self.vmfb)
