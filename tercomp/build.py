"""From a traced tern graph to a CompiledModule: the steps every entry point shares.

tc.compile (and through it tc.grad's modules), tc.compile_train_step and tc.compile_lm
differ in what they trace, which passes they run and how they lower the result (one
function, or entry points over mutable globals): each says so in one `Pipeline` and
hands it to `build` with the traced graph; everything else is here, once:

    opts = BuildOptions.resolve(target, vulkan_target=..., flags=..., device=..., ...)
    pipeline = Pipeline("compile", passes=("simplify",),
                        lower=lambda g, ctx, params: to_mlir(g, ctx, params=params,
                                                             targets=opts.names))
    exe = build(pipeline, graph, opts, dumper=dumper)

`BuildOptions.resolve` checks every option before anything is traced (targets, extra
flags, device, threads, the ternary strategy); `build` looks the program up in the
compile cache (`Pipeline.key`: the traced program, the pipeline, the options and the
compiler), runs the passes, checks what the targets can store, binds large constants
as parameters (`weights`), records the `mlir` stage, merges the kernels' IREE flags
into the target's, compiles in this process or in an iree-compile subprocess
(codegen.targets.needs_isolation), dumps IREE's phases, and makes the CompiledModule.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

from iree.compiler.version import VERSION as IREE_VERSION

from ._version import __version__
from .codegen.iree_session import compile_vmfb, new_session
from .lowering import check_storage
from .codegen.params import ParamTable, check_mode, parameterized, resolve_mode
from .codegen.targets import check_extra_flags, needs_isolation, resolve_targets, target_flags
from .kernels.table import table_key
from .kernels.ternary.strategies import check_strategy
from .errors import CompileError
from .ir.digest import digest
from .passes import Dumper, run_pipeline
from .runtime import compile_cache
from .runtime.devices import check_threads, pick_device
from .runtime.loader import from_parts
from .runtime.module import CompiledModule
from .runtime.signature import Signature


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


@dataclass(frozen=True)
class Pipeline:
    """How a traced program becomes a module: what tc.compile, tc.compile_lm and
    tc.compile_train_step each decide, handed with the traced graph to `build`.

    `driver` names the entry point (a part of the cache key); `passes` are
    passes.run_pipeline's names or (name, options) pairs; `lower(graph, ctx, params)`
    lowers the graph after the passes (-> lowering.Lowered) and `lower_key` says
    what it adds that the graph does not show (a stateful entry point's globals and
    bindings); `weights` is codegen.params' mode; `function` names the signature's
    function (default the graph's); with `stages_on_hit` a cache hit still runs the
    passes and the lowering, so that `exe.ir(stage)` has every stage, and skips only IREE
    (else a hit skips everything after tracing); `stage_prefix` prefixes the stage names
    (`step.ternary`)."""
    driver: str
    passes: tuple
    lower: Callable
    lower_key: str = ""
    weights: str = "auto"
    function: str | None = None
    stages_on_hit: bool = True
    stage_prefix: str = ""

    def key(self, graph, opts: "BuildOptions") -> str:
        """The compile-cache key of `graph` built by this pipeline with `opts` (STYLE.md
        §17: the key is the program). The traced graph whole (ir.digest: its text, every
        constant's bytes, its argument and result structure; its source locations where
        check_numerics puts them in the module's messages), this pipeline (passes with
        their options, the lowering's key, the weights mode), the build options, and the
        compiler: tercomp's own sources, the kernel rows this host offers the targets and
        IREE's version. The key is taken from what the trace produced, so whatever code
        or data the trace read (a class, a patched method, a module-level function, a
        callable attribute, a config field) is in it exactly as far as it changed the
        program."""
        passes = json.dumps(list(self.passes), sort_keys=True, default=repr)
        # source locations only where a pass writes them into the module (its messages)
        locations = "check_numerics" in [p if isinstance(p, str) else p[0] for p in self.passes]
        return compile_cache.key("pipeline", self.driver, digest(graph, locations), passes,
                                 self.lower_key,
                                 self.weights, self.function or "", opts.cache_parts(),
                                 compiler_digest(), table_key(opts.names), __version__,
                                 IREE_VERSION)


@functools.lru_cache(maxsize=1)
def compiler_digest() -> str:
    """sha256 of tercomp's own source files (its kernel templates too): the passes and the
    lowering that run after the key is taken are this code."""
    root = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for d, dirs, files in os.walk(root):
        dirs.sort()
        for f in sorted(files):
            if f.endswith((".py", ".mlir")):
                with open(os.path.join(d, f), "rb") as fh:
                    data = fh.read()
                name = os.path.relpath(os.path.join(d, f), root).encode()
                h.update(len(name).to_bytes(8, "little") + name)
                h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def build(pipeline: Pipeline, graph, opts: BuildOptions, *, dumper: Dumper,
          meta: dict | None = None, hit_meta: dict | None = None, cache: bool = True,
          stage: str = "") -> CompiledModule:
    """Compile traced `graph` as `pipeline` says into a CompiledModule.

    With `cache`, the compile cache is looked up by `pipeline.key(graph, opts)` before
    anything else runs; a miss is compiled and stored under that key. `meta` is recorded
    in the module's meta (and its cache entry); `hit_meta` is what a hit that skips the
    passes puts over the entry's own (what the trace knows that the entry may not: an
    LM's tokenizer). The module keeps the stages the dumper recorded (`tern`, one per
    pass), the `mlir` stage and, with a dump directory, IREE's phases."""
    check_mode(pipeline.weights)
    key = pipeline.key(graph, opts) if cache else None
    hit = compile_cache.lookup(key) if key is not None else None
    if hit is not None and not pipeline.stages_on_hit:
        cached, vmfb, irpa = hit
        return from_parts(cached, vmfb, irpa, device=opts.device, threads=opts.threads,
                          cache_key=key, cache_hit=True, **(hit_meta or {}))
    g = run_pipeline(graph, list(pipeline.passes), dumper)
    check_storage(g, opts.targets)
    signature = Signature.from_graph(g)
    if pipeline.function:
        signature = dataclasses.replace(signature, function=pipeline.function)
    stages = {f"{pipeline.stage_prefix}{k}": v for k, v in dumper.stages.items()}
    session, ctx = new_session()
    mode = resolve_mode([g], pipeline.weights)
    table = ParamTable()
    swap = parameterized([g], table) if mode == "irpa" else contextlib.nullcontext()
    with swap:
        module, kernel_flags, kernels = pipeline.lower(g, ctx, table)
    irpa = table.archive()
    with ctx:
        text = module.operation.get_asm(large_elements_limit=16)
    dumper.add("mlir", text, ext="mlir")
    stages["mlir"] = text
    flags = opts.flags(kernel_flags)
    meta = {"flags": flags, "drivers": opts.drivers, "iree_version": IREE_VERSION,
            "cache_hit": hit is not None, "weights": mode, "parameters": sorted(table.arrays),
            "ternary": kernels, "numerics": g.meta.get("numerics"),
            **{k: g.meta[k] for k in ("saved_for_backward",) if k in g.meta}, **(meta or {})}
    if key is not None:
        meta["cache_key"] = key
    if hit is not None:
        _, vmfb, _ = hit
    else:
        vmfb = compile_vmfb(module, flags, session=session,
                            isolate=needs_isolation(opts.names, flags, opts.user_flags,
                                                    opts.isolate),
                            stage=stage or f"the IREE compile for {', '.join(opts.names)}")
    if dumper.dump_dir:
        with ctx:
            stages.update(_dump_phases(dumper.dump_dir, flags, str(module)))
    exe = CompiledModule(vmfb, signature, stages, device=opts.device, threads=opts.threads,
                         targets=opts.names, meta=meta, weights=irpa, weights_scope=table.scope)
    if key is not None and hit is None:
        compile_cache.store(key, exe)
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
        raise CompileError(f"dumping IREE's compilation phases failed: {e}") from None
    finally:
        os.unlink(src)
    phases = {}
    for fname in sorted(os.listdir(path)):
        name = fname.split(".")[-2] if fname.count(".") >= 2 else fname.rsplit(".", 1)[0]
        with open(os.path.join(path, fname), errors="replace") as f:
            phases[name] = f.read()
    return phases
