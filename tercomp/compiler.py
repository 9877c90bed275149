"""tc.compile: trace -> passes -> MLIR -> IREE -> CompiledModule.

Stages are recorded (and written to `dump_dir` / $TERCOMP_DUMP as numbered files):
`tern` (traced), one per pass (`simplify`, ...), `mlir` (linalg, constants elided), and,
with a dump directory, IREE's own phases under `iree/`.
"""
from __future__ import annotations

import os

from .codegen.iree_session import compile_module, new_session
from .codegen.lower import to_mlir
from .codegen.targets import target_flags
from .errors import TercompError
from .ir import Graph
from .passes import Dumper, run_pipeline
from .runtime.module import CompiledModule
from .runtime.signature import Signature
from .trace import trace

DEFAULT_PASSES = ["simplify"]


def compile(fn, *example_args, target: str = "llvm-cpu", ternary: str = "auto",
            dump_dir: str | None = None, flags=(), passes=None, device: str = "local-task",
            name: str = "forward") -> CompiledModule:
    """Trace `fn` (a function, an nn.Module, a transformed function such as tc.grad(f), or
    an already traced Graph) on `example_args` and compile it with IREE.

    >>> exe = tc.compile(model, tc.spec(("B", 784), "float32"))
    >>> y = exe(np.ones((7, 784), np.float32))
    """
    target_args = target_flags(target)
    graph = fn if isinstance(fn, Graph) else trace(fn, *example_args, name=name)
    dumper = Dumper(dump_dir)
    pipeline = list(DEFAULT_PASSES if passes is None else passes)
    graph = run_pipeline(graph, pipeline, dumper)
    session, ctx = new_session()
    module = to_mlir(graph, ctx)
    with ctx:
        dumper.add("mlir", module.operation.get_asm(large_elements_limit=16), ext="mlir")
    all_flags = target_args + list(flags)
    vmfb = compile_module(session, module, all_flags, stage=f"the IREE compile for {target}")
    if dumper.dump_dir:
        with ctx:
            _dump_phases(dumper, all_flags, str(module))
    return CompiledModule(vmfb, Signature.from_graph(graph), dumper.stages, device=device,
                          targets=[target], meta={"flags": all_flags})


def _dump_phases(dumper: Dumper, flags, module_text: str):
    """IREE's phases (input, abi, preprocessing, global-optimization, dispatch-creation,
    flow, stream, executable-sources, ...): `--dump-compilation-phases-to` is an option
    of the iree-compile tool, not of the in-process session, so the tool runs once more
    on the dumped MLIR."""
    import subprocess
    import sys
    path = os.path.join(dumper.dump_dir, "iree")
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".mlir", delete=False) as f:
        f.write(module_text)
        src = f.name
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
