"""CompiledModule: a .vmfb loaded into iree-runtime, called with NumPy arrays.

This package imports only iree.runtime, NumPy and tercomp's leaf modules (errors,
dtypes, pytree, dimexpr), never the compiler (tercomp.codegen, iree.compiler) nor sympy,
so a saved artifact runs where only iree-base-runtime is installed. Which device a
module runs on, and opening it, is tercomp.runtime.devices; the artifact file format
is tercomp.runtime.artifact, and tc.load is tercomp.runtime.loader.
"""
from __future__ import annotations

import functools
import mmap
import threading

import iree.runtime as rt
import numpy as np

from .. import dimexpr, pytree
from ..errors import TercompError, ConfigError, DeviceUnavailable, ExecutionError
from . import artifact
from .devices import (TARGET_DRIVERS, available_drivers, check_threads, open_device, pick_device,
                      warn_if_lavapipe_mismatch)
from .numerics import report as report_numerics
from .fenced import FencedFunction, is_fenced
from .signature import Signature


def _flat(in_tree) -> bool:
    """Whether the arguments are the input arrays themselves (no nested pytree)."""
    return in_tree is None or (in_tree[0] == "tuple" and not any(in_tree[1]))


class _TransientStorage:
    """The storage a function compiled with `iree.abi.transients` (lowering.lower_graph's
    `transients`) takes as its last argument: IREE places every buffer that lives only
    within a call there, so the calls reuse the same memory instead of the queue pool's
    (slabs mapped, faulted in and unmapped again each call on local-task). Its bytes are
    the function's reflection's `iree.abi.transients.size.constant` for static shapes;
    with symbolic dims IREE's size query (`iree.abi.transients.size`, a function of the
    same arguments) tells them, asked once per new set of input shapes, and the storage
    grows to the largest. Calls are synchronous, so one storage serves every call, one
    at a time (`lock`)."""

    def __init__(self, device, size: int, size_fn=None):
        self.device, self.size_fn, self.lock = device, size_fn, threading.Lock()
        self.sizes = {}                   # input shapes -> bytes, for size_fn
        self.size, self.view = 0, None
        self._grow(size)

    def _grow(self, size: int):
        size = max(int(size), 64)
        if size > self.size:
            buf = self.device.allocator.allocate_buffer(memory_type=rt.MemoryType.DEVICE_LOCAL,
                                                        allowed_usage=rt.BufferUsage.DEFAULT,
                                                        allocation_size=size)
            self.size, self.view = size, buf.create_view(rt.Shape([size]), 1)

    def for_call(self, arrays):
        """The storage for a call with `arrays` (grown first where a symbolic size needs it)."""
        if self.size_fn is not None:
            key = tuple(tuple(a.shape) for a in arrays)
            if key not in self.sizes:
                self.sizes[key] = int(self.size_fn(*arrays, self.view))
                self._grow(self.sizes[key])
        return self.view

    @classmethod
    def of(cls, fn, device, functions):
        """The storage of iree.runtime function `fn`, or None for a function that does not
        take one; `functions` looks the size query up by name."""
        refl = fn.vm_function.reflection
        if "iree.abi.transients" not in refl.get("iree.abi.declaration", ""):
            return None
        size = refl.get("iree.abi.transients.size.constant")
        if size is not None or "iree.abi.transients.size" not in refl:
            return cls(device, int(size or 0))
        return cls(device, 0, functions[refl["iree.abi.transients.size"]])


def _plain_arrays_key(args) -> tuple | None:
    """(shape, dtype) of each argument when all are C-contiguous NumPy arrays, else None."""
    key = []
    for a in args:
        if type(a) is not np.ndarray or not a.flags.c_contiguous:
            return None
        key.append((a.shape, a.dtype))
    return tuple(key)


def _is_page_aligned(data) -> bool:
    """Is `data` an mmap or a view of page-aligned memory (an artifact's mapped file)?"""
    if isinstance(data, mmap.mmap):
        return True
    return isinstance(data, memoryview) and len(data) > 0 and \
        np.frombuffer(data, np.uint8).ctypes.data % mmap.PAGESIZE == 0


def vm_module(instance, vmfb):
    """The VmModule of `vmfb`: over its own memory where that is page-aligned (a mapped
    artifact: the module's code and inline constants then exist once in RAM, the file's
    pages, and IREE imports the constants in place), else a copy."""
    if _is_page_aligned(vmfb):
        return rt.VmModule.wrap_buffer(instance, vmfb)
    return rt.VmModule.copy_buffer(instance, vmfb)


def _as_bytes(data):
    """`data` as bytes where it is a view or a map (None and bytes as they are)."""
    return bytes(data) if isinstance(data, (mmap.mmap, memoryview)) else data


def _page_aligned(data):
    """`data` (bytes-like) in page-aligned memory: as it is if it is there already (an
    mmap, or a view of an artifact's mapped file), else copied into anonymous memory."""
    if _is_page_aligned(data):
        return data
    mem = mmap.mmap(-1, len(data))
    mem[:] = data
    return mem


@functools.lru_cache(maxsize=None)
def _dtype_of(element_type) -> np.dtype:
    return np.dtype(rt.HalElementType.map_to_dtype(element_type))


def _to_host(arr, host_memory: bool = False) -> np.ndarray:
    """Copy an iree.runtime DeviceArray to a NumPy array (`host_memory`: the caller
    knows it is mappable, as every buffer of a local-task/local-sync device is: its
    buffer view is mapped and copied directly, 5 us a result against 17 us through
    DeviceArray.to_host(), which asks the buffer and the dtype every call)."""
    if host_memory:
        view = arr._buffer_view
        if view.byte_length == 0:
            return np.empty(view.shape, _dtype_of(view.element_type))
        return np.array(view.map().asarray(view.shape, _dtype_of(view.element_type)))
    if arr._is_mappable():
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
    parameters (scope `weights_scope`) the module reads. `vmfb` and `weights` may be
    views of a mapped artifact file (tc.load): IREE then runs over the file's pages, and
    the module's weights, inline or parameters, are in RAM once.
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
        self._transients = None

    def _load(self):
        if self._fn is None:
            if self.device is None:
                wanted = [d for t in self.targets for d in TARGET_DRIVERS.get(t, ())]
                raise DeviceUnavailable(
                    f"no device here runs this module (compiled for {', '.join(self.targets)}, "
                    f"which needs {' or '.join(dict.fromkeys(wanted))})",
                    hint=f"available drivers: {', '.join(available_drivers())}")
            held = open_device(self.device, self.threads)
            hal_device = held.device
            warn_if_lavapipe_mismatch(self.device, self.meta.get("flags", ()))
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
                ctx.add_vm_module(vm_module(ctx.instance, self._vmfb))
                fn = ctx.modules.module[self.signature.function]
                # IREE has copied the module's code into executable memory: the file's
                # pages leave this process's map, and those its calls read (the weights)
                # come back at the first call (bench/conv.py's ResNet, 1.17 MiB packed:
                # 1.4 -> 1.3 MiB of the file resident after a call)
                artifact.release_pages(self._vmfb)
            except Exception as e:
                raise DeviceUnavailable(f"the module does not load on {self.device}: {e}",
                                        hint=f"it was compiled for {', '.join(self.targets)}") from None
            self._transients = _TransientStorage.of(fn, hal_device, ctx.modules.module)
            self._ctx, self._held, self._hal_device, self._fn = ctx, held, hal_device, fn
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

    # vmfb and weights may be views of a mapped artifact (tc.load): the properties give
    # bytes, the *_view ones the memory where it lies
    vmfb = property(lambda self: _as_bytes(self._vmfb),
                    lambda self, value: setattr(self, "_vmfb", value),
                    doc="The IREE module (.vmfb) as bytes.")
    weights = property(lambda self: _as_bytes(self._weights),
                       lambda self, value: setattr(self, "_weights", value),
                       doc="The .irpa archive of the module's parameters (None without "
                           "parameters), as bytes.")

    @property
    def vmfb_view(self) -> memoryview:
        """`vmfb` without a copy: a view of the module where it lies (a mapped file)."""
        return memoryview(self._vmfb)

    @property
    def weights_view(self) -> memoryview | None:
        """`weights` without a copy: a view of the archive where it lies (a mapped file)."""
        return None if self._weights is None else memoryview(self._weights)

    def function(self, name: str):
        """The iree.runtime function `name` of the loaded module, called with NumPy arrays
        and returning iree.runtime DeviceArrays, unchecked. Every function of one module
        shares its loaded state (weights, mutable globals such as a KV cache). A function
        of IREE's async-external model (a language model's step) is called through
        runtime.fenced.FencedFunction, the same way."""
        self._load()
        try:
            fn = self._ctx.modules.module[name]
        except (KeyError, AttributeError):
            raise ConfigError(f"the module has no function {name!r}") from None
        if is_fenced(fn.vm_function):       # a language model's step (tc.compile_lm)
            return FencedFunction(self._ctx.vm_context, self._hal_device, fn.vm_function)
        return fn

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
            if self._transients is None:
                res = fn(*arrays)
            else:       # one storage: one call at a time
                with self._transients.lock:
                    res = fn(*arrays, self._transients.for_call(arrays))
        except Exception as e:
            raise ExecutionError(f"the IREE runtime failed running {sig.function} on "
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
        artifact.save(self, path)

    def ir(self, stage: str) -> str:
        """The text of one compile stage: 'tern', a pass name ('simplify', 'autodiff',
        'ternary'), 'mlir', or an IREE phase (when compiled with dump_dir)."""
        if stage in self.stages:
            return self.stages[stage]
        raise ConfigError(f"no stage {stage!r} was recorded",
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
        return len(self._vmfb)
