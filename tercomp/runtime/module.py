"""CompiledModule: a .vmfb loaded into iree-runtime, called with NumPy arrays."""
from __future__ import annotations

import numpy as np

from ..errors import DeviceUnavailable, InputError, TercompError
from ..trace import pytree
from .signature import Signature


def available_drivers() -> list:
    import iree.runtime as rt
    try:
        return sorted(rt.query_available_drivers())
    except Exception:
        return ["local-sync", "local-task"]


def _make_config(device: str):
    import iree.runtime as rt
    drivers = available_drivers()
    driver = device.split(":")[0]
    if driver not in drivers:
        raise DeviceUnavailable(f"device {device!r} is not available",
                                hint=f"available drivers: {', '.join(drivers)}")
    try:
        return rt.Config(device)
    except Exception as e:
        raise DeviceUnavailable(f"device {device!r} could not be opened: {e}",
                                hint=f"available drivers: {', '.join(drivers)}") from None


class CompiledModule:
    """A compiled function. `exe(*args)` takes the same pytree of arrays as the traced
    example arguments and returns the same pytree of results, as NumPy arrays.

    >>> exe = tc.compile(model, tc.spec(("B", 784)))
    >>> logits = exe(x)                # any batch size
    >>> print(exe.ir("mlir"))         # the linalg module
    """

    def __init__(self, vmfb: bytes, signature: Signature, stages: dict | None = None,
                 device: str = "local-task", targets=("llvm-cpu",), meta: dict | None = None):
        self.vmfb = vmfb
        self.signature = signature
        self.stages = stages or {}
        self.targets = list(targets)
        self.meta = meta or {}
        self.device = device
        self._fn = None

    def _load(self):
        if self._fn is None:
            import iree.runtime as rt
            config = _make_config(self.device)
            ctx = rt.SystemContext(config=config)
            vm_module = rt.VmModule.copy_buffer(ctx.instance, self.vmfb)
            ctx.add_vm_module(vm_module)
            self._ctx = ctx
            self._config = config
            self._fn = ctx.modules.module[self.signature.function]
        return self._fn

    def __call__(self, *args, keep_on_device: bool = False):
        sig = self.signature
        try:
            leaves, _, tree = pytree.flatten(tuple(args))
        except Exception as e:
            raise InputError(f"cannot read the arguments: {e}") from None
        arrays = sig.check_inputs(leaves)
        fn = self._load()
        try:
            res = fn(*arrays)
        except Exception as e:
            raise TercompError(f"the IREE runtime failed running {sig.function}: {e}") from None
        res = list(res) if isinstance(res, (list, tuple)) else [res]
        if not keep_on_device:
            res = [np.asarray(r.to_host()) if hasattr(r, "to_host") else np.asarray(r) for r in res]
            res = [r.astype(np.bool_) if s.dtype == "i1" else r for r, s in zip(res, sig.outputs)]
        if sig.out_tree is None and len(res) == 1:
            return res[0]
        return pytree.unflatten(sig.out_tree, res) if sig.out_tree is not None else tuple(res)

    def ir(self, stage: str) -> str:
        """The text of one compile stage: 'tern', a pass name ('simplify', 'autodiff',
        'ternary'), 'mlir', or an IREE phase (when compiled with dump_dir)."""
        if stage in self.stages:
            return self.stages[stage]
        raise TercompError(f"no stage {stage!r} was recorded",
                           hint=f"recorded stages: {', '.join(self.stages)}; IREE phases are kept "
                                "when compiling with dump_dir= or TERCOMP_DUMP=dir")

    @property
    def vmfb_size(self) -> int:
        return len(self.vmfb)
