"""In-process IREE compilation of an MLIR module built with the Python builders.

IREE's C API prints diagnostics to the process's stderr; we capture file descriptor 2
around each compile so that a failure becomes a CompileError carrying IREE's text.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Callable, Sequence

from iree.compiler import ir
from iree.compiler.api import Output, Session, Source

from ..errors import CompileError

HOST_CPU_FLAGS = (
    "--iree-hal-target-device=local",
    "--iree-hal-local-target-device-backends=llvm-cpu",
    "--iree-llvmcpu-target-cpu=host",
)


@contextlib.contextmanager
def capture_stderr():
    """Redirect fd 2 into a temp file; yields a list that receives the text on exit."""
    captured: list[str] = []
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield captured
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            captured.append(tmp.read().decode("utf-8", "replace"))


def new_session() -> tuple[Session, ir.Context]:
    """A compiler session and an MLIR context (every dialect loaded) to build modules in.

    The context is our own, not the session's: a context taken from a session with
    `session.context` is never freed (IREE 3.13 keeps it alive, ~3.2 MiB per compile
    with the dialects loaded), so modules go to the session as text (compile_module)."""
    ctx = ir.Context()
    ctx.load_all_available_dialects()
    return Session(), ctx


def compile_module(session: Session, module: ir.Module, flags: Sequence[str],
                   stage: str = "iree-compile") -> bytes:
    """Compile `module` (built in `session.context`) with IREE flags; returns the .vmfb bytes."""
    try:
        session.set_flags(*flags)
    except Exception as e:  # IREE reports unknown flags as ValueError
        raise CompileError(f"IREE rejected the compiler flags {list(flags)}: {e}",
                           hint="check the spelling of extra flags") from None
    # Hand the module over as text, parsed by the session. The Python builders of some
    # structured ops (linalg.fill, linalg.transpose) leave their region empty; the
    # custom printer hides that and the parser rebuilds the body, but handed over
    # directly such a module segfaults IREE 3.13 in-process. Bytecode keeps the empty
    # region, so text it is (hex-encoded constants: ~0.7 s per 64 MB).
    with module.context:
        text = module.operation.get_asm(large_elements_limit=None, large_resource_limit=None,
                                        assume_verified=True).encode()
    inv = session.invocation()
    source = Source.wrap_buffer(session, text, buffer_name="tercomp.mlir")
    with capture_stderr() as diag:
        inv.enable_console_diagnostics()
        ok = inv.parse_source(source) and inv.execute()
        if ok:
            out = Output.open_membuffer()
            inv.output_vm_bytecode(out)
            vmfb = bytes(out.map_memory())
    if not ok:
        raise CompileError(f"IREE failed during {stage}:\n{diag[0].strip()}",
                           hint="run with dump_dir= or TERCOMP_DUMP=dir to see every stage")
    return vmfb


def build_and_compile(build: Callable[[], None], flags: Sequence[str]) -> tuple[str, bytes]:
    """Build a module with `build()` (called inside the context, with an insertion point
    at the module body) and compile it; returns (MLIR text, vmfb). For tests and benches."""
    session, ctx = new_session()
    with ctx, ir.Location.unknown():
        module = ir.Module.create()
        with ir.InsertionPoint(module.body):
            build()
        if not module.operation.verify():
            raise CompileError("the generated MLIR module does not verify")
        text = str(module)
        return text, compile_module(session, module, flags)
