"""Run a `python -c` script, or the `tercomp` command line, in a child process without
starting python: the hostile-input tests (test_hostile_models, test_hostile_ir) run each
case in its own process, with an address-space limit and a timeout, so that a case that
hangs, crashes or allocates without bound fails that case alone, and test_cli runs each
command in its own. A fresh interpreter each paid python's start and tercomp's import
(`from tercomp import models`: ~1.3 s of a 2-core CI machine's time); here each is a
fork of multiprocessing's forkserver, a single-threaded process that imported tercomp
once (and made no device), so a case costs a fork.

The child is a process of its own as a fresh interpreter is: its own address space
(what it allocates or corrupts is not the test's), its own limits (the script sets
them), its own working directory, threads and devices, killed at the timeout, and a
crash is its exit code (negative: the signal). What it prints is what Python code
writes to sys.stdout and sys.stderr (not what C code writes to the file descriptors).
A test of what an import does, or of the console script itself, still needs a fresh
interpreter (subprocess)."""
import contextlib
import io
import multiprocessing
import os
import sys
import traceback

# what the forkserver imports once; a script importing more imports it in each child
PRELOAD = ["box", "tercomp", "tercomp.models", "tercomp.ops", "tercomp.compiler", "tercomp.cli"]

_context = None


def run(code, *args, timeout=60, cwd=None, stdin=None, env=None):
    """(exit code, output: its stdout then its stderr) of `python -c code *args` run in a
    forked child in `cwd` (`stdin`: the text on its standard input, else an empty one;
    `env`: variables set in its environment, which tercomp reads when it uses them, not
    at import); a child still running after `timeout` seconds is killed and raises
    TimeoutError, as subprocess.run(timeout=...) raises."""
    rc, out, err = _run(code, args, timeout, cwd, stdin, env)
    return rc, out + err


def cli(*args, stdin=None, timeout=300, env=None):
    """(exit code, stdout, stderr) of the `tercomp` command line with `args` (the console
    script's tercomp.cli.main) run in a forked child, as `run` runs a script."""
    return _run("import sys\nfrom tercomp.cli import main\nsys.exit(main(sys.argv[1:]))\n",
                args, timeout, None, stdin, env)


def _forkserver():
    global _context
    if _context is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _context = ctx
    return _context


def _run(code, args, timeout, cwd, stdin, env):
    ctx = _forkserver()
    here, there = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(there, code, [str(a) for a in args],
                                         None if cwd is None else str(cwd), stdin, env))
    p.start()
    there.close()
    out = err = ""
    if here.poll(timeout):
        try:
            out, err = here.recv()
        except EOFError:      # the child died before it sent anything (a signal)
            pass
        p.join(timeout)       # it exits once it has sent
    if p.is_alive():
        p.kill()
        p.join()
        raise TimeoutError(f"the child running {code[:60]!r}... took more than {timeout} s")
    return p.exitcode, out, err


def _child(conn, code, argv, cwd, stdin, env):
    """In the child: run `code` as `python -c code *argv` would; send back what it printed
    to stdout and to stderr (a traceback where it raised, as python prints one), and exit
    with its status (1 where it raised)."""
    out, err = io.StringIO(), io.StringIO()
    rc = 0
    try:
        if cwd is not None:
            os.chdir(cwd)
        os.environ.update({k: str(v) for k, v in (env or {}).items()})
        sys.argv = ["-c", *argv]
        sys.stdin = io.TextIOWrapper(io.BytesIO((stdin or "").encode()), encoding="utf-8")
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
            except SystemExit as e:
                if isinstance(e.code, int) or e.code is None:
                    rc = e.code or 0
                else:             # sys.exit("message"), as python prints it
                    print(e.code, file=sys.stderr)
                    rc = 1
            except BaseException:
                traceback.print_exc()
                rc = 1
    finally:
        conn.send((out.getvalue(), err.getvalue()))
        conn.close()
    os._exit(rc)         # no atexit handlers, no flushing of the parent's buffers
