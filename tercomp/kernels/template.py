"""Kernel templates: each hand-written dispatch is a `.mlir` file in templates/, a jinja2
template whose first line lists its parameters (`{# params: name, n, kb #}`) and whose
statements are lines that start with `%%` (`%% for b in range(mb)`), rendered by
name (as iree-turbine keeps its kernel templates). `render` refuses a missing or an
unknown parameter, and StrictUndefined refuses a name the template uses but does not
declare, so a renamed parameter fails here, in Python, not when IREE parses the text.
SSA values that cross a macro boundary are the macro's arguments (the caller names them
once), never a name two pieces of text agree on by convention.

Shared pieces are macros in templates/lib.mlir (the `stream.executable` shell, a row
load with its prefetch) and templates/avx2_quant_lib.mlir (activation quantization).

>>> print(render("rms_norm", name="k", n=8, rows=8).splitlines()[0])
stream.executable private @k {
"""
from __future__ import annotations

import functools
import os
import re

import jinja2
import jinja2.meta

from ..errors import InternalError
from ..runtime import files

DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates")


class _BytecodeCache(jinja2.FileSystemBytecodeCache):
    """The templates compiled to Python once per machine, not once per process (10 of
    them took 1.3 s of a fresh process's first compile_lm): jinja2's own cache, keyed by
    each template's name and a checksum of its source, in tercomp's cache directory as
    it is when a template is first loaded. A directory that cannot be written only
    costs the compile."""

    def __init__(self):
        super().__init__(directory=files.cache_dir())

    def _get_cache_filename(self, bucket):
        self.directory = os.path.join(files.cache_dir(), "templates")
        os.makedirs(self.directory, exist_ok=True)
        return super()._get_cache_filename(bucket)

    def load_bytecode(self, bucket):
        try:
            super().load_bytecode(bucket)
        except OSError:
            pass

    def dump_bytecode(self, bucket):
        try:
            super().dump_bytecode(bucket)
        except OSError:
            pass


_PARAMS = re.compile(r"\A\{#\s*params:([^#]*)#\}")
# MLIR writes `{%m}` (a dynamic size): statements are lines that start with `%%`
# (`%% for i in range(rows)`), and the block delimiters are ones MLIR never writes.
_ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(DIR), undefined=jinja2.StrictUndefined,
                          line_statement_prefix="%%", block_start_string="<%",
                          block_end_string="%>", trim_blocks=True, lstrip_blocks=True,
                          keep_trailing_newline=True, autoescape=False,
                          extensions=["jinja2.ext.do"], bytecode_cache=_BytecodeCache())


def names() -> list[str]:
    """Every kernel template (the files that are not macro libraries)."""
    return sorted(f[:-5] for f in os.listdir(DIR) if f.endswith(".mlir") and "_lib" not in f
                  and f != "lib.mlir")


@functools.lru_cache(maxsize=None)
def params(name: str) -> tuple[str, ...]:
    """The parameters template `name` declares on its first line."""
    with open(os.path.join(DIR, name + ".mlir")) as f:
        found = _PARAMS.match(f.read())
    if found is None:
        raise InternalError(f"kernel template {name}.mlir does not list its parameters",
                            hint="start it with {# params: a, b, ... #}")
    return tuple(p.strip() for p in found.group(1).split(",") if p.strip())


def used(name: str) -> set[str]:
    """The names template `name` reads from its parameters (jinja2.meta)."""
    with open(os.path.join(DIR, name + ".mlir")) as f:
        return jinja2.meta.find_undeclared_variables(_ENV.parse(f.read()))


def render(template: str, /, **values) -> str:
    """The text of kernel template `template` with its parameters `values` (every
    declared parameter given, none other)."""
    name = template
    declared = params(name)
    missing = [p for p in declared if p not in values]
    extra = sorted(set(values) - set(declared))
    if missing or extra:
        raise InternalError(f"kernel template {name}.mlir: "
                            + "; ".join(([f"missing {', '.join(missing)}"] if missing else [])
                                        + ([f"unknown {', '.join(extra)}"] if extra else [])),
                            hint=f"it takes {', '.join(declared)}")
    return _ENV.get_template(name + ".mlir").render(**values)
