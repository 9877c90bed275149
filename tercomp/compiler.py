"""tc.compile: trace -> passes -> MLIR -> IREE -> CompiledModule.

Stages are recorded (and written to `dump_dir` / $TERCOMP_DUMP as numbered files):
`tern` (traced), one per pass (`simplify`, ...), `mlir` (linalg, constants elided), and,
with a dump directory, IREE's own phases under `iree/`.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys

from iree.compiler.version import VERSION as IREE_VERSION

from . import __version__
from .codegen.iree_session import compile_vmfb, new_session
from .codegen.lower import check_storage, to_mlir
from .codegen.params import ParamTable, check_mode, parameterized, resolve_mode
from .codegen.ternary_strategies import check_strategy
from .codegen.targets import check_extra_flags, needs_isolation, resolve_targets, target_flags
from .errors import TercompError
from .ir import Graph
from .passes import Dumper, run_pipeline
from .passes.numerics import enabled as numerics_enabled
from .runtime import cache as compile_cache
from .runtime.devices import check_threads, pick_device
from .runtime.module import CompiledModule
from .runtime.signature import Signature
from .trace import trace
from .autodiff import GradFn

DEFAULT_PASSES = ["simplify"]


def compile(fn, *example_args, target="llvm-cpu", ternary: str = "auto",
            dump_dir: str | None = None, flags=(), passes=None, device: str | None = None,
            threads: int | None = None, cache: bool = True, vulkan_target: str | None = None,
            cuda_target: str | None = None, name: str = "forward",
            weights: str = "auto", isolate: bool | None = None,
            check_numerics: bool | None = None) -> CompiledModule:
    """Trace `fn` (a function, an nn.Module, a transformed function such as tc.grad(f), or
    an already traced Graph) on `example_args` and compile it with IREE.

    `target` is a name or a list of names (one artifact for all): "llvm-cpu" (the host
    CPU), "llvm-cpu-generic" (any x86-64), "vulkan" (`vulkan_target=`, default
    vp_android_baseline_2022), "cuda" (`cuda_target=`, default sm_80); see
    tercomp.codegen.targets. `device` ("local-task", "local-sync", "vulkan", "cuda";
    default: the first present one the targets run on) and `threads` (local-task pool
    size) say where the module runs. With `cache` (default), a module compiled before
    with the same MLIR, flags and versions comes from $TERCOMP_CACHE_DIR
    (default ~/.cache/tercomp) without running IREE; `exe.meta["cache_hit"]` tells.

    `weights` says where the model's constants go: "inline" (in the .vmfb), "irpa"
    (every constant of 4096 elements or more, packed ternary weights included, becomes
    a `#flow.parameter.named<"model"::name>` parameter whose bytes are an .irpa archive
    in `exe.weights`, bound at load time and saved with the module), or "auto" (the
    default: "irpa" when the constants total more than 64 MiB, else "inline");
    `exe.meta["weights"]` says which was used. See tercomp.codegen.params.

    `check_numerics=True` (default: $TERCOMP_CHECK_NUMERICS=1) makes every call check
    each op's result and raise NumericsError naming the first op, and its source line,
    that produced a NaN or Inf, or a cross_entropy label out of range (passes/numerics.py).

    `isolate=True` runs IREE in a subprocess (the iree-compile tool), so that a compiler
    crash becomes a CompileError with IREE's message instead of ending the process;
    extra `flags` always compile that way, and so do GPU targets unless `isolate=False`
    (the default, None, isolates them: see codegen.targets.needs_isolation).

    >>> exe = tc.compile(model, tc.spec(("B", 784), "float32"))
    >>> y = exe(np.ones((7, 784), np.float32))
    >>> exe = tc.compile(model, tc.spec(("B", 784)), target=["llvm-cpu", "vulkan"])
    >>> exe = tc.compile(big_model, tc.spec(("B", 4096)), weights="irpa")   # small .vmfb
    """
    targets = resolve_targets(target, vulkan_target=vulkan_target, cuda_target=cuda_target)
    target_names = [t.name for t in targets]
    target_args = target_flags(target_names, vulkan_target=vulkan_target, cuda_target=cuda_target)
    user_flags = check_extra_flags(flags)
    device = pick_device(target_names, device)      # a bad device fails before IREE runs
    check_threads(target_names, device, threads)
    check_strategy(ternary, target_names)        # a CPU-only kernel for a GPU fails here
    check_mode(weights)
    dumper = Dumper(dump_dir)
    graph = _trace_stages(fn, example_args, name, dumper)
    pipeline = list(DEFAULT_PASSES if passes is None else passes)
    if ternary != "off":
        at = pipeline.index("simplify") if "simplify" in pipeline else len(pipeline)
        pipeline.insert(at, ("ternary", {"strategy": ternary, "targets": target_names}))
    if numerics_enabled(check_numerics):
        pipeline.append("check_numerics")      # last: simplify would fold its checks away
    graph = run_pipeline(graph, pipeline, dumper)
    check_storage(graph, targets)
    session, ctx = new_session()
    weights_mode = resolve_mode([graph], weights)
    table = ParamTable()
    swap = parameterized([graph], table) if weights_mode == "irpa" else contextlib.nullcontext()
    with swap:
        module, kernel_flags, kernels = to_mlir(graph, ctx, params=table, targets=target_names)
    irpa = table.archive()
    with ctx:
        dumper.add("mlir", module.operation.get_asm(large_elements_limit=16), ext="mlir")
    all_flags = target_args + user_flags
    all_flags += [f for f in kernel_flags if f not in all_flags]
    meta = {"flags": all_flags, "drivers": [d for t in targets for d in t.drivers],
            "numerics": graph.meta.get("numerics"),
            "iree_version": IREE_VERSION, "cache_hit": False, "weights": weights_mode,
            "parameters": sorted(table.arrays), "ternary": kernels,
            "saved_for_backward": graph.meta.get("saved_for_backward", [])}
    key = hit = None
    if cache:
        with ctx:
            full = module.operation.get_asm(binary=True, large_elements_limit=None,
                                            large_resource_limit=None, assume_verified=True)
        # with parameters the module text holds only their names: hash their bytes too
        params_digest = hashlib.sha256(irpa).hexdigest() if irpa is not None else ""
        key = compile_cache.key(full, "\0".join(all_flags), __version__, IREE_VERSION,
                                params_digest)
        hit = compile_cache.lookup(key)
        meta.update(cache_key=key, cache_hit=hit is not None)
    if hit is not None:
        _, vmfb, irpa = hit
    else:
        vmfb = compile_vmfb(module, all_flags, session=session,
                            isolate=needs_isolation(target_names, all_flags, user_flags, isolate),
                            stage=f"the IREE compile for {', '.join(target_names)}")
    if dumper.dump_dir:
        with ctx:
            _dump_phases(dumper, all_flags, str(module))
    exe = CompiledModule(vmfb, Signature.from_graph(graph), dumper.stages, device=device,
                         threads=threads, targets=target_names, meta=meta, weights=irpa,
                         weights_scope=table.scope)
    if key is not None and hit is None:
        compile_cache.store(key, exe)
    return exe


def _trace_stages(fn, example_args, name, dumper: Dumper) -> Graph:
    """Trace `fn`. For a gradient transform (tc.grad / tc.value_and_grad) the stages are
    `tern`, the traced function itself, and `autodiff`, the joint forward + backward
    graph that the transform's reverse walk (autodiff.backward) built from it."""
    if isinstance(fn, Graph):
        return fn
    if isinstance(fn, GradFn):
        dumper.add("tern", str(trace(fn.fn, *example_args, name=name)))
        graph = trace(fn, *example_args, name=name)
        dumper.add("autodiff", str(graph))
        return graph
    return trace(fn, *example_args, name=name)


def _dump_phases(dumper: Dumper, flags, module_text: str):
    """IREE's phases (input, abi, preprocessing, global-optimization, dispatch-creation,
    flow, stream, executable-sources, ...): `--dump-compilation-phases-to` is an option
    of the iree-compile tool, not of the in-process session, so the tool runs once more
    on the dumped MLIR."""
    path = os.path.join(dumper.dump_dir, "iree")
    os.makedirs(path, exist_ok=True)
    # a fixed source name, so the phases are iree_module.1.input.mlir, iree_module.2.abi.mlir, ...
    src = os.path.join(dumper.dump_dir, "iree-module.mlir")
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
    _collect_phases(dumper, path)


def _collect_phases(dumper: Dumper, path: str):
    if not os.path.isdir(path):
        return
    for fname in sorted(os.listdir(path)):
        stage = fname.split(".")[-2] if fname.count(".") >= 2 else fname.rsplit(".", 1)[0]
        with open(os.path.join(path, fname), errors="replace") as f:
            dumper.stages[stage] = f.read()
