"""From lowered tern graphs to a CompiledModule: the steps every entry point shares.

tc.compile (and through it tc.grad's and compile_train_step's modules) and
tc.compile_lm differ in what they trace and how they lower it (one function, or
entry points over mutable globals); everything around that is here, once:

    opts = BuildOptions.resolve(target, vulkan_target=..., flags=..., device=..., ...)
    exe = build(lambda ctx, params: to_mlir(graph, ctx, params=params, targets=opts.names),
                [graph], opts, signature=Signature.from_graph(graph), dumper=dumper)

`BuildOptions.resolve` checks every option before anything is traced (targets, extra
flags, device, threads, the ternary strategy); `build` checks what the targets can
store, binds large constants as parameters (`weights`), records the `mlir` stage,
merges the kernels' IREE flags into the target's, looks the module up in the compile
cache, compiles it in this process or in an iree-compile subprocess
(codegen.targets.needs_isolation), dumps IREE's phases, and makes the CompiledModule.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass

from iree.compiler.version import VERSION as IREE_VERSION

from . import __version__
from .codegen.iree_session import compile_vmfb, module_text, new_session
from .codegen.lower import check_storage
from .codegen.params import ParamTable, check_mode, parameterized, resolve_mode
from .codegen.targets import check_extra_flags, needs_isolation, resolve_targets, target_flags
from .kernels.ternary.strategies import check_strategy
from .errors import TercompError
from .passes import Dumper
from .runtime import cache as compile_cache
from .runtime.devices import check_threads, pick_device
from .runtime.module import CompiledModule


@dataclass(frozen=True)
class BuildOptions:
    """Where and how a module is compiled and run, checked (BuildOptions.resolve)."""
    targets: tuple          # codegen.targets.Target, one per target name
    user_flags: tuple       # extra IREE flags (compile in a subprocess)
    device: str | None      # the runtime device (None: no device for the targets here)
    threads: int | None
    isolate: bool | None    # None: GPU targets and extra flags in a subprocess

    @classmethod
    def resolve(cls, target="llvm-cpu", *, vulkan_target=None, cuda_target=None, flags=(),
                device=None, threads=None, ternary="auto", isolate=None) -> "BuildOptions":
        targets = resolve_targets(target, vulkan_target=vulkan_target, cuda_target=cuda_target)
        names = [t.name for t in targets]
        user_flags = check_extra_flags(flags)
        device = pick_device(names, device)        # a bad device fails before tracing
        check_threads(names, device, threads)
        check_strategy(ternary, names)             # a CPU-only kernel for a GPU fails here
        return cls(tuple(targets), tuple(user_flags), device, threads, isolate)

    @property
    def names(self) -> list:
        return [t.name for t in self.targets]

    @property
    def drivers(self) -> list:
        return [d for t in self.targets for d in t.drivers]

    def flags(self, kernel_flags=()) -> list:
        """Every IREE flag: the targets', the user's, then the kernels' own."""
        arch = {f"{t.name}_target": t.arch for t in self.targets if t.name in ("vulkan", "cuda")}
        out = target_flags(self.names, **arch) + list(self.user_flags)
        return out + [f for f in kernel_flags if f not in out]

    def cache_parts(self) -> str:
        """What of these options changes a compiled module, for a compile-cache key."""
        return "\0".join([*(f for t in self.targets for f in t.flags), *self.names,
                          "--", *self.user_flags])


def build(lower, graphs, opts: BuildOptions, *, signature, dumper: Dumper,
          stages: dict | None = None, weights: str = "auto", meta: dict | None = None,
          cache: bool = True, cache_key: str | None = None, stage: str = "") -> CompiledModule:
    """Compile the module that `lower(ctx, params)` (-> codegen.lower.Lowered) builds from
    `graphs` into a CompiledModule calling `signature`.

    `stages`: the stage texts the module keeps (default `dumper.stages`); the `mlir`
    stage and, with a dump directory, IREE's phases are added to it. `weights`: "inline",
    "irpa" or "auto" (codegen.params). With `cache`, a module compiled before with the
    same MLIR, parameters, flags and versions is taken from the compile cache; a
    `cache_key` computed by the caller before tracing (tc.compile_lm) is used to store
    the result instead."""
    check_mode(weights)
    for g in graphs:
        check_storage(g, opts.targets)
    stages = dumper.stages if stages is None else stages
    session, ctx = new_session()
    mode = resolve_mode(list(graphs), weights)
    table = ParamTable()
    swap = parameterized(list(graphs), table) if mode == "irpa" else contextlib.nullcontext()
    with swap:
        module, kernel_flags, kernels = lower(ctx, table)
    irpa = table.archive()
    with ctx:
        text = module.operation.get_asm(large_elements_limit=16)
    dumper.add("mlir", text, ext="mlir")
    stages["mlir"] = text
    flags = opts.flags(kernel_flags)
    meta = {"flags": flags, "drivers": opts.drivers, "iree_version": IREE_VERSION,
            "cache_hit": False, "weights": mode, "parameters": sorted(table.arrays),
            "ternary": kernels, **(meta or {})}
    hit, full = None, None
    if cache and cache_key is None:
        full = module_text(module)          # what IREE is given, printed once for both
        # with parameters the module text holds only their names: hash their bytes too
        params_digest = hashlib.sha256(irpa).hexdigest() if irpa is not None else ""
        cache_key = compile_cache.key(full, "\0".join(flags), __version__, IREE_VERSION,
                                      params_digest)
        hit = compile_cache.lookup(cache_key)
    if cache_key is not None:
        meta.update(cache_key=cache_key, cache_hit=hit is not None)
    if hit is not None:
        _, vmfb, irpa = hit
    else:
        vmfb = compile_vmfb(module, flags, session=session, text=full,
                            isolate=needs_isolation(opts.names, flags, opts.user_flags,
                                                    opts.isolate),
                            stage=stage or f"the IREE compile for {', '.join(opts.names)}")
    if dumper.dump_dir:
        with ctx:
            stages.update(_dump_phases(dumper.dump_dir, flags, str(module)))
    exe = CompiledModule(vmfb, signature, stages, device=opts.device, threads=opts.threads,
                         targets=opts.names, meta=meta, weights=irpa, weights_scope=table.scope)
    if cache and hit is None:
        compile_cache.store(cache_key, exe)
    return exe


def _dump_phases(dump_dir: str, flags, module_text: str) -> dict:
    """IREE's phases (input, abi, preprocessing, global-optimization, dispatch-creation,
    flow, stream, executable-sources, ...), written under `dump_dir`/iree and returned
    by name: `--dump-compilation-phases-to` is an option of the iree-compile tool, not of
    the in-process session, so the tool runs once more on the dumped MLIR."""
    path = os.path.join(dump_dir, "iree")
    os.makedirs(path, exist_ok=True)
    # a fixed source name, so the phases are iree_module.1.input.mlir, iree_module.2.abi.mlir, ...
    src = os.path.join(dump_dir, "iree-module.mlir")
    with open(src, "w") as f:
        f.write(module_text)
    tool = os.path.join(os.path.dirname(sys.executable), "iree-compile")
    cmd = [tool if os.path.exists(tool) else "iree-compile", src, *flags,
           f"--dump-compilation-phases-to={path}", "--mlir-elide-elementsattrs-if-larger=16",
           "-o", os.devnull]
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as e:
        raise TercompError(f"dumping IREE's compilation phases failed: {e}") from None
    finally:
        os.unlink(src)
    phases = {}
    for fname in sorted(os.listdir(path)):
        name = fname.split(".")[-2] if fname.count(".") >= 2 else fname.rsplit(".", 1)[0]
        with open(os.path.join(path, fname), errors="replace") as f:
            phases[name] = f.read()
    return phases
