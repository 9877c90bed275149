"""Weights as named parameters: `util.global`s bound to an `.irpa` archive at load time.

`tc.compile(..., weights=)` chooses where a model's constants live:

- ``"inline"``: every constant is an `arith.constant` inside the .vmfb.
- ``"irpa"``: every constant of at least `MIN_ELEMENTS` elements (packed ternary
  weights included) becomes a named parameter; the .vmfb holds only its name and type,
  the bytes go into an IREE parameter archive (`.irpa`) that `CompiledModule` binds when
  it loads (scope `SCOPE`) and `exe.save()` writes as `weights.irpa`.
- ``"auto"`` (the default): "irpa" when the graph's constants total more than
  `AUTO_IRPA_BYTES` (64 MiB), else "inline".

In MLIR a parameter is

    util.global private @fc1.weight = #flow.parameter.named<"model"::"fc1.weight"> : tensor<16x12xf32>
    ...
    %fc1.weight = util.global.load immutable @fc1.weight : tensor<16x12xf32>

During lowering, each such constant's value is swapped for a `Parameter` (restored
afterwards): it is no longer a NumPy array, so lowerings that would embed a constant
operand themselves (`tern.ternary_matmul` with its packed weights) read the loaded
global as a runtime tensor instead, and nothing of the bytes reaches the module.

How tc.compile uses it:

    table = ParamTable()
    if resolve_mode([graph], "auto") == "irpa":  # else lower without `parameterized`
        with parameterized([graph], table):      # large constants -> Parameters
            module = to_mlir(graph, ctx, params=table).module
    irpa_bytes = table.archive()                 # None when no constant was large
"""
from __future__ import annotations

import contextlib
import mmap
import os
import re
import tempfile

import numpy as np
import iree.runtime as rt
from iree.compiler import ir
from iree.compiler.dialects import util

from ..errors import ConfigError

MODES = ("inline", "irpa", "auto")
SCOPE = "model"
MIN_ELEMENTS = 4096                  # smaller constants stay inline even in "irpa" mode
AUTO_IRPA_BYTES = 64 * 1024 * 1024   # "auto" goes to irpa above this many constant bytes


def check_mode(mode) -> str:
    if mode not in MODES:
        raise ConfigError(f"unknown weights mode {mode!r}; expected one of "
                          f"{', '.join(map(repr, MODES))}",
                          hint="'inline' embeds constants in the .vmfb, 'irpa' stores large "
                               "ones in a parameter archive, 'auto' picks by total size")
    return mode


def _constants(graphs):
    for g in graphs:
        for op in g.ops:
            if op.opname == "constant" and isinstance(op.attrs.get("value"), np.ndarray):
                yield op


def constant_bytes(graphs) -> int:
    """Total size in bytes of the constants of `graphs`."""
    return sum(op.attrs["value"].nbytes for op in _constants(graphs))


def resolve_mode(graphs, mode: str) -> str:
    """"inline" or "irpa" for `mode` ("auto" decides by `constant_bytes`)."""
    if check_mode(mode) == "auto":
        return "irpa" if constant_bytes(graphs) > AUTO_IRPA_BYTES else "inline"
    return mode


class Parameter:
    """Stands in for a constant's NumPy value while the module is lowered: the constant
    is read from the parameter `name` instead of being embedded."""

    __slots__ = ("name", "array")

    def __init__(self, name: str, array: np.ndarray):
        self.name, self.array = name, array

    @property
    def shape(self):
        return self.array.shape

    @property
    def dtype(self):
        return self.array.dtype

    def __repr__(self):
        return f"Parameter({self.name!r}, {self.array.dtype}{list(self.array.shape)})"


def _wants_parameter(value: np.ndarray, min_elements: int) -> bool:
    # i1 has no byte layout IREE agrees on for parameters; such tensors are masks anyway.
    return value.size >= min_elements and value.dtype != np.bool_


class ParamTable:
    """The parameters of one module: unique names, their arrays, and the globals emitted."""

    def __init__(self, scope: str = SCOPE):
        self.scope = scope
        self.arrays: dict[str, np.ndarray] = {}
        self._by_array: dict[int, str] = {}      # id(array) -> name (one global per array)
        self._globals: set = set()
        self.anchor = None                       # globals are inserted before this op

    def add(self, name: str, array: np.ndarray) -> Parameter:
        """Register `array` under a unique name derived from `name`."""
        if id(array) in self._by_array:
            return Parameter(self._by_array[id(array)], array)
        base = re.sub(r"[^A-Za-z0-9_.]", "_", name) or "param"
        unique, i = base, 1
        while unique in self.arrays:
            unique, i = f"{base}_{i}", i + 1
        self.arrays[unique] = array
        self._by_array[id(array)] = unique
        return Parameter(unique, array)

    def load(self, param: Parameter, type_: ir.RankedTensorType) -> ir.Value:
        """`util.global.load` of the parameter's global at the current insertion point,
        declaring the global (before `anchor`) on first use."""
        if param.name not in self._globals:
            attr = ir.Attribute.parse(f'#flow.parameter.named<"{self.scope}"::"{param.name}"> : {type_}')
            with ir.InsertionPoint(self.anchor):
                util.GlobalOp(param.name, type_, sym_visibility="private", initial_value=attr)
            self._globals.add(param.name)
        return util.GlobalLoadOp(type_, param.name, is_immutable=True).result

    def archive(self) -> memoryview | None:
        """The `.irpa` archive of every parameter, or None when there are none: a map of
        the file IREE wrote (unlinked at once), so the archive lives in the page cache,
        not in the process's own memory (a model's weights are its largest part)."""
        if not self.arrays:
            return None
        index = rt.ParameterIndex()
        # byte views of the arrays, kept alive until the archive is written
        views = [np.ascontiguousarray(a).view(np.uint8).reshape(-1) for a in self.arrays.values()]
        for name, view in zip(self.arrays, views):
            index.add_buffer(name, view)
        fd, path = tempfile.mkstemp(suffix=".irpa")
        os.close(fd)
        try:
            index.create_archive_file(path)
            with open(path, "rb") as f:
                return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        finally:
            os.unlink(path)


@contextlib.contextmanager
def parameterized(graphs, table: ParamTable, min_elements: int = MIN_ELEMENTS):
    """Within the block, the value of every constant of `graphs` with at least
    `min_elements` elements is a `Parameter` registered in `table`; on exit the NumPy
    values are put back, so the graphs are unchanged."""
    swapped = []
    try:
        for op in list(_constants(graphs)):
            v = op.attrs["value"]
            if _wants_parameter(v, min_elements):
                name = op.results[0].name
                op.attrs["value"] = table.add(name, v)
                swapped.append((op, v))
        yield table
    finally:
        for op, v in swapped:
            op.attrs["value"] = v
