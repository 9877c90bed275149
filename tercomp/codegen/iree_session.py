"""IREE compilation of an MLIR module built with the Python builders, in this process
or in an iree-compile subprocess (compile_vmfb chooses; both are given the same text).

In process, IREE's C API prints diagnostics to the process's stderr; we capture file
descriptor 2 around each compile so that a failure becomes a CompileError carrying
IREE's text. A crash there (SIGSEGV, an LLVM abort) ends the interpreter, which is why
some compiles run in a subprocess, where a crash is a CompileError.

IREE verifies the whole module after each of its ~400 passes by default; the module
tercomp gives it is verified once, when IREE parses it, and the re-verification after
every pass (a check of IREE's own passes, ~25% of a training step's compile) is off
unless TERCOMP_VERIFY_IR=1 (what to set when reporting a suspected IREE bug: a pass
that breaks the IR is then named in the error instead of failing later).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import tempfile
from typing import Callable, Sequence

from iree.compiler import ir
from iree.compiler.api import Output, Session, Source
from iree.compiler.api import ctypes_dl as _capi
from iree.compiler.tools.binaries import find_tool

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


def module_text(module: ir.Module) -> bytes:
    """The module as MLIR text, every constant written out: what IREE is given, in
    process and in a subprocess alike.

    Not bytecode, and not the module object itself: the Python builders of some
    structured ops (linalg.fill, linalg.transpose, linalg.matmul with transposed
    operands) leave their region or indexing maps empty. The custom printer hides that
    and the parser rebuilds them, but bytecode keeps them empty and IREE 3.13 then
    crashes (a SIGSEGV in `MatmulTransposeAOp::isDefaultIndexingMaps` for a gradient's
    matmul), in process and in iree-compile alike. Hex-encoded constants cost ~0.7 s
    per 64 MB of text."""
    with module.context:
        return module.operation.get_asm(large_elements_limit=None, large_resource_limit=None,
                                        assume_verified=True).encode()


def verify_each_pass() -> bool:
    """Whether IREE re-verifies the module after every pass (TERCOMP_VERIFY_IR=1)."""
    return os.environ.get("TERCOMP_VERIFY_IR", "") not in ("", "0")


def _set_verify(inv, enabled: bool) -> None:
    """ireeCompilerInvocationSetVerifyIR, which IREE 3.13's Python wrapper does not
    expose (iree-compile's --verify is a tool option, not a session flag)."""
    fn = getattr(_capi._dylib, "ireeCompilerInvocationSetVerifyIR", None)
    if fn is None:           # an IREE without it keeps verifying: slower, never wrong
        return
    fn.restype, fn.argtypes = None, [ctypes.c_void_p, ctypes.c_bool]
    fn(inv._inv_p, enabled)


def compile_module(session: Session, module: ir.Module, flags: Sequence[str],
                   stage: str = "iree-compile", text: bytes | None = None) -> bytes:
    """Compile `module` in this process with IREE flags; returns the .vmfb bytes.
    `text`: module_text(module), when the caller has printed it already. A crash of
    IREE here ends the process: see compile_vmfb for the safe choice."""
    try:
        session.set_flags(*flags)
    except Exception as e:  # IREE reports unknown flags as ValueError
        raise CompileError(f"IREE rejected the compiler flags {list(flags)}: {e}",
                           hint="check the spelling of extra flags") from None
    inv = session.invocation()
    _set_verify(inv, verify_each_pass())
    source = Source.wrap_buffer(session, module_text(module) if text is None else text,
                                buffer_name="tercomp.mlir")
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


def compile_source(source: bytes, flags: Sequence[str], stage: str = "iree-compile",
                   timeout: float = 3600) -> bytes:
    """Compile MLIR `source` (text or bytecode) with the iree-compile tool in a
    subprocess; the .vmfb bytes. A crash of IREE is a CompileError naming `stage` and
    the signal, with IREE's own stack dump."""
    with tempfile.TemporaryDirectory(prefix="tercomp-") as tmp:
        src, out = os.path.join(tmp, "module.mlir"), os.path.join(tmp, "module.vmfb")
        with open(src, "wb") as f:
            f.write(source)
        try:
            verify = [] if verify_each_pass() else ["--verify=false"]
            r = subprocess.run([find_tool("iree-compile"), src, *flags, *verify, "-o", out],
                               capture_output=True, text=True, timeout=timeout,
                               stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise CompileError(f"iree-compile ran past {timeout:.0f} s during {stage}") from None
        except (OSError, subprocess.SubprocessError) as e:
            raise CompileError(f"running iree-compile for {stage} failed: {e}") from None
        if r.returncode != 0:
            raise CompileError(f"IREE {_how_it_ended(r.returncode)} during {stage}:\n"
                               f"{r.stderr.strip()}",
                               hint="run with dump_dir= or TERCOMP_DUMP=dir to see every stage")
        with open(out, "rb") as f:
            return f.read()


def _how_it_ended(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"crashed ({name})"
    return "failed"


def compile_vmfb(module: ir.Module, flags: Sequence[str], *, isolate: bool,
                 stage: str = "iree-compile", session: Session | None = None,
                 text: bytes | None = None) -> bytes:
    """The one way tercomp hands a module to IREE: in an iree-compile subprocess when
    `isolate` (see targets.needs_isolation), else in this process. `text`: the module
    as module_text prints it, when the caller has it (printing a training step's module
    takes ~0.07 s)."""
    if isolate:
        return compile_source(module_text(module) if text is None else text, flags, stage)
    return compile_module(session or Session(), module, flags, stage, text=text)


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
