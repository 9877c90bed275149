"""tc.compile: trace -> passes -> MLIR -> IREE -> CompiledModule.

Stages are recorded (and written to `dump_dir` / $TERCOMP_DUMP as numbered files):
`tern` (traced), one per pass (`simplify`, ...), `mlir` (linalg, constants elided), and,
with a dump directory, IREE's own phases under `iree/`.
"""
from __future__ import annotations

from .build import BuildOptions, Pipeline, build
from .lowering import to_mlir
from .codegen.params import check_mode
from .ir import Graph
from .passes import Dumper
from .passes.check_numerics import enabled as numerics_enabled
from .runtime.module import CompiledModule
from .tracing import trace
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
    from the same traced program with the same options and compiler comes from
    $TERCOMP_CACHE_DIR (default ~/.cache/tercomp) without running IREE
    (build.Pipeline.key); `exe.meta["cache_hit"]` tells.

    `weights` says where the model's constants go: "inline" (in the .vmfb), "irpa"
    (every constant of 4096 elements or more, packed ternary weights included, becomes
    a `#flow.parameter.named<"model"::name>` parameter whose bytes are an .irpa archive
    in `exe.weights`, bound at load time and saved with the module), or "auto" (the
    default: "irpa" when the constants total more than 64 MiB, else "inline");
    `exe.meta["weights"]` says which was used. See tercomp.codegen.params.

    `check_numerics=True` (default: $TERCOMP_CHECK_NUMERICS=1) makes every call check
    each op's result and raise NumericsError naming the first op, and its source line,
    that produced a NaN or Inf, or a cross_entropy label out of range (passes/check_numerics.py).

    `isolate=True` runs IREE in a subprocess (the iree-compile tool), so that a compiler
    crash becomes a CompileError with IREE's message instead of ending the process;
    extra `flags` always compile that way, and so do GPU targets unless `isolate=False`
    (the default, None, isolates them: see codegen.targets.needs_isolation).

    >>> exe = tc.compile(model, tc.spec(("B", 784), "float32"))
    >>> y = exe(np.ones((7, 784), np.float32))
    >>> exe = tc.compile(model, tc.spec(("B", 784)), target=["llvm-cpu", "vulkan"])
    >>> exe = tc.compile(big_model, tc.spec(("B", 4096)), weights="irpa")   # small .vmfb
    """
    opts = BuildOptions.resolve(target, vulkan_target=vulkan_target, cuda_target=cuda_target,
                                flags=flags, device=device, threads=threads, ternary=ternary,
                                isolate=isolate)
    check_mode(weights)
    dumper = Dumper(dump_dir)
    graph = _trace_stages(fn, example_args, name, dumper)
    return build(pipeline(opts, passes=passes, ternary=ternary, check_numerics=check_numerics,
                          weights=weights),
                 graph, opts, dumper=dumper, cache=cache)


def pipeline(opts: BuildOptions, *, passes=None, ternary: str = "auto",
             check_numerics: bool | None = None, weights: str = "auto",
             driver: str = "compile", transients: bool = False) -> Pipeline:
    """tc.compile's Pipeline: `passes` (default simplify), the ternary pass before
    simplify unless ternary="off", check_numerics last; one function lowered as it is,
    with `transients` taking the caller's transient storage (lowering.lower_graph)."""
    names = opts.names
    steps = list(DEFAULT_PASSES if passes is None else passes)
    if ternary != "off":
        at = steps.index("simplify") if "simplify" in steps else len(steps)
        steps.insert(at, ("ternary", {"strategy": ternary, "targets": names}))
    if numerics_enabled(check_numerics):
        steps.append("check_numerics")      # last: simplify would fold its checks away
    return Pipeline(driver, tuple(steps), weights=weights,
                    lower=lambda g, ctx, params: to_mlir(g, ctx, params=params, targets=names,
                                                         transients=transients),
                    lower_key="transients" if transients else "")


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
