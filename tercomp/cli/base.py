"""What the `tercomp` commands share: the usage error and the one-line error text, the
argument parser and its value types, the input and spec syntax, the progress spinner.

Imports only the runtime and the leaf modules: a command loads the compiler side
itself, on first use, so `tercomp run` or `tercomp serve MODEL.tcm` never pays for it.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import threading
import time

import numpy as np

from ..dtypes import ALIASES, DTYPES, dtype_name, numpy_dtype
from ..errors import TercompError
from ..runtime.loader import load


class UsageError(Exception):
    """Bad command-line arguments (exit status 2)."""


class Parser(argparse.ArgumentParser):
    def error(self, message):        # one line instead of argparse's usage + message
        raise UsageError(f"{message} (see `{self.prog} --help`)")


class LazyChoices:
    """The `choices` of an argument, read from `load()` on first use (a check or the
    help text), so that building the parser imports nothing heavy. When `load` raises
    ImportError every value is accepted, as argparse does with choices=None.

    Set it on the action after add_argument, which formats the choices once:

    >>> a = argparse.ArgumentParser().add_argument("--x")
    >>> a.choices = LazyChoices(lambda: ("p", "q"))
    >>> "q" in a.choices, tuple(a.choices)
    (True, ('p', 'q'))
    """

    def __init__(self, load):
        self._load, self._choices = load, None

    def _get(self):
        if self._choices is None:
            try:
                self._choices = tuple(self._load())
            except ImportError:
                self._choices = ()
        return self._choices

    def __contains__(self, value) -> bool:
        return value in self._get() or not self._get()

    def __iter__(self):
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


# -- argument values -----------------------------------------------------------------------

def is_decimal(text: str) -> bool:
    """ASCII digits only: str.isdigit() is also true of '²' and '１２'."""
    return re.fullmatch(r"[0-9]+", text) is not None


def positive_int(text: str) -> int:
    """An argparse type: '8' -> 8; '0', '-1', '２' are errors."""
    if not is_decimal(text) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def check_text(value, flag: str) -> None:
    """A usage error when `value` (a str or None) is not valid UTF-8."""
    # a non-UTF-8 argument reaches Python as lone surrogates (PEP 383)
    if value is not None:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise UsageError(f"{flag} is not valid UTF-8 text") from None


_ID = re.compile(r"[0-9]+")
_MAX_ID = 2 ** 31 - 1          # token ids travel as int32


def int_list(text: str, what: str) -> list:
    """'1,2, 3' -> [1, 2, 3]: ASCII digits separated by commas (spaces around them
    allowed); '1 2', '1,,2', '１２', '' and ids past int32 are usage errors."""
    items = [t.strip() for t in text.split(",")]
    if not text.strip():
        raise UsageError(f"{what} is empty: give comma-separated token ids like 1,2,3")
    for t in items:
        if not _ID.fullmatch(t):
            shown = "an empty item" if not t else repr(t)
            raise UsageError(f"{what} must be comma-separated token ids (ASCII digits) like 1,2,3; "
                             f"{shown} in {text!r} is not one")
        # by length first: int() of more than 4300 digits is a ValueError of its own
        if len(t.lstrip("0")) > len(str(_MAX_ID)) or int(t) > _MAX_ID:
            shown = t if len(t) <= 24 else f"{t[:12]}...({len(t)} digits)"
            raise UsageError(f"{what}: {shown} is too large for a token id (at most {_MAX_ID})")
    return [int(t) for t in items]


def is_artifact(model: str) -> bool:
    """Whether MODEL names a compiled artifact (.tcm) rather than a model to compile."""
    return os.path.isfile(model) and not model.endswith(".gguf")


def _dtype(text: str) -> str:
    if text not in DTYPES and text not in ALIASES:
        raise UsageError(f"unknown dtype {text!r}; use one of {', '.join(DTYPES)}")
    return numpy_dtype(dtype_name(text)).name


def parse_spec(text: str):
    """'B,784:f32' -> tc.spec(('B', 784), 'float32')."""
    import tercomp as tc
    dims_text, _, dtype = text.rpartition(":") if ":" in text else (text, "", "f32")
    dims = []
    for d in filter(None, (p.strip() for p in dims_text.split(","))):
        if is_decimal(d):
            dims.append(int(d))
        elif d.isidentifier():
            dims.append(d)
        else:
            raise UsageError(f"bad dim {d!r} in --example {text!r}: use an int or a name like B")
    return tc.spec(tuple(dims), _dtype(dtype or "f32"))


def parse_input(text: str) -> np.ndarray:
    """A .npy path, '@path.npy', or iree-run-module style '2x3xf32=1,2,3,4,5,6'."""
    if text.startswith("@") or (text.endswith(".npy") and "=" not in text):
        path = text.lstrip("@")
        try:
            return np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise UsageError(f"cannot read the input {path}: {e}") from None
    m = re.fullmatch(r"((?:[0-9]+x)*)([a-z]+[0-9]*)=(.*)", text, re.S)
    if not m:
        raise UsageError(f"bad --input {text!r}: use a .npy file or SHAPExDTYPE=VALUES "
                         "like 2x3xf32=1,2,3,4,5,6")
    shape = tuple(int(d) for d in m.group(1).split("x") if d)
    dtype = np.dtype(_dtype(m.group(2)))
    items = [v for v in re.split(r"[,\s\[\]]+", m.group(3)) if v]
    try:
        values = np.array([float(v) if dtype.kind == "f" else int(float(v)) for v in items], dtype)
    except (ValueError, OverflowError) as e:
        raise UsageError(f"bad value in --input {text[:80]!r}: {e} (values must fit in "
                         f"{dtype.name})") from None
    n = int(np.prod(shape))
    if values.size == 1:
        return np.full(shape, values[0], dtype)
    if values.size != n:
        raise UsageError(f"--input {text!r}: shape {list(shape)} needs {n} values, got {values.size}")
    return values.reshape(shape)


# -- artifacts -------------------------------------------------------------------------------

def load_function(args, command: str):
    """The CompiledModule of args.artifact; a language model is a usage error (its
    command is `tercomp generate`)."""
    exe = load(args.artifact, device=args.device, threads=args.threads)
    if not hasattr(exe, "signature"):
        raise UsageError(f"{args.artifact} is a language model: `tercomp {command}` runs a "
                         f"function; generate with `tercomp generate {args.artifact} --prompt-ids 1,2,3`")
    return exe


# -- progress --------------------------------------------------------------------------------

@contextlib.contextmanager
def spinner(label: str):
    """A spinner with elapsed seconds on stderr while the block runs (after half a
    second), only when stderr is a terminal. It writes to a duplicate of fd 2 because
    IREE's diagnostics capture redirects fd 2 during a compile."""
    if not sys.stderr.isatty():
        yield
        return
    fd = os.dup(sys.stderr.fileno())
    done = threading.Event()

    def spin():
        start, frames, i = time.monotonic(), "|/-\\", 0
        if done.wait(0.5):                 # short compiles: no flicker
            return
        while not done.wait(0.1):
            os.write(fd, f"\r{frames[i % 4]} {label} {time.monotonic() - start:5.1f}s".encode())
            i += 1
        os.write(fd, b"\r\x1b[K")          # erase the line

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join()
        os.close(fd)


# -- errors ----------------------------------------------------------------------------------

def one_line(e: TercompError) -> str:
    """A TercompError as `tercomp: error:` prints it: one line, its hint and location."""
    lines = [line.strip() for line in e.message.strip().splitlines() if line.strip()]
    text = " ".join(lines) or type(e).__name__
    if len(text) > 300:                    # IREE's diagnostics: the first line, -v for all
        text = lines[0] + " (-v shows the details)"
    elif e.hint:
        text += f" (hint: {e.hint})"
    if e.loc is not None and str(e.loc):
        text = f"{e.loc}: {text}"
    return text
