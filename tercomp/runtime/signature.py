"""The signature of a compiled function: names, shapes (with symbolic dims), dtypes and
the pytree structure of arguments and results. Plain JSON, so artifacts carry it."""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass

import numpy as np

from .. import dimexpr
from ..dtypes import DTYPES, dtype_name
from ..errors import InputError, ParseError
from ..pytree import jsonable

_NP_DTYPES = {k: np.dtype(v[0]) for k, v in DTYPES.items()}
_DECLARATION = re.compile(r"@[^(]*\((.*)\)\s*->\s*\((.*)\)\s*$", re.S)
_TENSOR = re.compile(r"tensor<((?:(?:\d+|\?)x)*)([a-z][a-z0-9]*)>")


def declared_types(declaration: str):
    """The argument and result types of a compiled function, from the declaration
    iree.runtime reflects (`iree.abi.declaration`: "sync func @f(%input0:
    tensor<?x8xf32>) -> (%output0: tensor<?x4xf32>)"), as two lists of (dims,
    element type) with None for a dynamic dim, or None for a type that is not a
    tensor; None when the text is not such a declaration.

    >>> declared_types("sync func @f(%input0: tensor<?x8xf32>) -> (%output0: tensor<i32>)")
    ([([None, 8], 'f32')], [([], 'i32')])
    """
    m = _DECLARATION.search(declaration)
    if m is None:
        return None
    return tuple(parse_types(group) for group in m.groups())


def parse_types(text: str) -> list:
    """"%a: tensor<2x?xf16>, %b: i32" -> [([2, None], 'f16'), None] (see declared_types)."""
    out = []
    for item in filter(None, (p.strip() for p in re.split(r",\s*(?=[%\w.]+\s*:)", text))):
        t = _TENSOR.fullmatch(item.partition(":")[2].strip())
        out.append(None if t is None else
                   ([None if d == "?" else int(d) for d in t.group(1).split("x")[:-1]], t.group(2)))
    return out


@dataclass
class TensorSig:
    name: str
    shape: list        # ints, or strings for symbolic dims ("B", "2*B")
    dtype: str         # tern dtype name: "f32", "i32", ...

    def describe(self):
        return f"{self.name}: [{', '.join(str(d) for d in self.shape)}] {self.dtype}"


@dataclass
class Signature:
    function: str
    inputs: list
    outputs: list
    in_tree: object = None
    out_tree: object = None

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> "Signature":
        """A Signature from its JSON form; InputError names a malformed entry (an unknown
        dtype, a dim that is neither a size nor a dim expression)."""
        sig = Signature(d["function"], [TensorSig(**t) for t in d["inputs"]],
                        [TensorSig(**t) for t in d["outputs"]], d.get("in_tree"), d.get("out_tree"))
        for t in sig.inputs + sig.outputs:
            if t.dtype not in _NP_DTYPES:
                raise InputError(f"{t.name}: unknown dtype {t.dtype!r} (known: {', '.join(_NP_DTYPES)})")
            if not isinstance(t.shape, list):
                raise InputError(f"{t.name}: the shape must be a list, got {t.shape!r}")
            for dim in t.shape:
                if isinstance(dim, bool) or not isinstance(dim, (int, str)) or (isinstance(dim, int) and dim < 0):
                    raise InputError(f"{t.name}: bad dim {dim!r}")
                if isinstance(dim, str):
                    try:
                        dimexpr.parse(dim)
                    except ParseError as e:
                        raise InputError(f"{t.name}: {e.message}") from None
        return sig

    def mismatch(self, inputs: list, outputs: list) -> str | None:
        """How this signature disagrees with a module's declared argument and result
        types (declared_types), or None: counts, ranks, static dims and dtypes. A dim
        symbolic here may be anything there; a type that is not a tensor is not compared."""
        for what, sigs, types in (("input", self.inputs, inputs), ("output", self.outputs, outputs)):
            if len(sigs) != len(types):
                return f"it names {len(sigs)} {what}s, the module's {self.function} has {len(types)}"
            for s, t in zip(sigs, types):
                if t is None:
                    continue
                dims, element = t
                shape = ", ".join("?" if d is None else str(d) for d in dims)
                if DTYPES[s.dtype][1] != element:
                    return f"{what} {s.name} is {s.dtype} in it and {element} in the module"
                if len(dims) != len(s.shape) or any(
                        isinstance(a, int) and b is not None and a != b for a, b in zip(s.shape, dims)):
                    return (f"{what} {s.name} has shape [{', '.join(map(str, s.shape))}] in it and "
                            f"[{shape}] in the module")
        return None

    @staticmethod
    def from_graph(graph) -> "Signature":

        def sig(name, t):
            return TensorSig(name, [d if isinstance(d, int) else str(d) for d in t.shape], t.dtype)
        return Signature(graph.name, [sig(v.name, v.type) for v in graph.inputs],
                         [sig(n, v.type) for n, v in zip(graph.output_names, graph.outputs)],
                         jsonable(graph.meta.get("in_tree")), jsonable(graph.meta.get("out_tree")))

    def leaves(self, args: tuple) -> list:
        """The input arrays of a call with `args`, matched against the compiled pytree
        structure (tuples/lists of the same length, dicts with the same keys, modules with
        the same parameters); then check_inputs. Errors name the argument and say what was
        expected and what came."""
        if self.in_tree is None:
            return self.check_inputs(list(args))
        flat = self.__dict__.get("_flat")
        if flat is None:        # every argument one array: the common case, checked cheaply
            flat = self.__dict__["_flat"] = (self.in_tree[0] == "tuple"
                                             and all(c is None for c in self.in_tree[1]))
        if flat and len(args) == len(self.in_tree[1]) and all(type(a) is np.ndarray for a in args):
            return self.check_inputs(args)
        out: list = []
        _match(self.in_tree, tuple(args), "", out, self)
        return self.check_inputs(out)

    def check_inputs(self, leaves) -> list:
        """Check count, shapes and dtypes; returns contiguous arrays. Symbolic dims must
        agree across inputs (every 'B' the same size)."""
        if len(leaves) != len(self.inputs):
            raise InputError(f"{self.function} takes {len(self.inputs)} input arrays "
                             f"({', '.join(s.name for s in self.inputs)}), got {len(leaves)}")
        bindings: dict = {}
        out = []
        for x, s in zip(leaves, self.inputs):
            if hasattr(x, "to_host") and hasattr(x, "shape") and not isinstance(x, np.ndarray):
                arr = x                      # a device array: checked by shape/dtype only
                shape, dt = tuple(x.shape), np.dtype(x.dtype)
            else:
                arr = np.asarray(x)
                shape, dt = arr.shape, arr.dtype
            if dt != _NP_DTYPES.get(s.dtype):
                try:
                    got = dtype_name(dt)
                except ValueError:
                    got = str(dt)
                if got != s.dtype:
                    raise InputError(f"input {s.name}: expected dtype {s.dtype}, got {got}",
                                     hint=f"convert with .astype(np.{np.dtype(DTYPES[s.dtype][0]).name})")
            if len(shape) != len(s.shape):
                raise InputError(f"input {s.name}: expected shape [{', '.join(map(str, s.shape))}], got "
                                 f"{list(shape)} (rank {len(shape)} instead of {len(s.shape)})")
            for k, (want, have) in enumerate(zip(s.shape, shape)):
                if isinstance(want, int):
                    if want != have:
                        raise InputError(f"input {s.name}: expected shape [{', '.join(map(str, s.shape))}], "
                                         f"got {list(shape)} (dim {k} must be {want})")
                elif want in bindings and bindings[want] != have:
                    raise InputError(f"input {s.name}: dim {k} ({want}) is {have} but {want} = "
                                     f"{bindings[want]} in an earlier input")
                else:
                    bindings[want] = have
            # np.ascontiguousarray would turn a 0-d array into shape (1,)
            out.append(np.asarray(arr, order="C") if isinstance(arr, np.ndarray) else arr)
        return out


def _where(path: str) -> str:
    return f"argument {path}" if path else "the arguments"


def _kind(x) -> str:
    if x is None:
        return "None"
    if isinstance(x, (list, tuple)):
        return f"a {type(x).__name__} of {len(x)}"
    if isinstance(x, dict):
        return f"a dict with keys {sorted(map(str, x))}"
    return f"a {type(x).__name__}"


def _match(tree, x, path: str, out: list, sig: Signature):
    """Walk the expected treedef and the given value together, appending leaves."""
    if tree is None:
        if isinstance(x, (np.ndarray, np.generic, int, float, bool)) or (
                hasattr(x, "to_host") and hasattr(x, "shape")):
            out.append(x)
            return
        hint = "convert it with np.asarray(..., dtype)" if isinstance(x, (list, tuple)) else None
        if len(out) < len(sig.inputs):
            s = sig.inputs[len(out)]
            raise InputError(f"input {s.name} (argument {path}): expected an array of shape "
                             f"[{', '.join(map(str, s.shape))}] {s.dtype}, got {_kind(x)}", hint=hint)
        raise InputError(f"{_where(path)}: expected an array, got {_kind(x)}", hint=hint)
    kind = tree[0]
    if kind == "none":
        if x is not None:
            raise InputError(f"{_where(path)}: expected None, got {_kind(x)}")
        return
    if kind in ("tuple", "list"):
        children = tree[1]
        if not path and len(x) != len(children):
            n = len(children)
            raise InputError(f"{sig.function} takes {n} argument{'s' if n != 1 else ''}, got {len(x)}")
        if not isinstance(x, (tuple, list)) or len(x) != len(children):
            raise InputError(f"{_where(path)}: expected a {kind} of {len(children)}, got {_kind(x)}")
        for i, (c, v) in enumerate(zip(children, x)):
            _match(c, v, f"{path}[{i}]" if path else str(i), out, sig)
        return
    if kind == "dict":
        keys, children = tree[1], tree[2]
        if callable(getattr(x, "parameters", None)) and not isinstance(x, dict):
            x = x.parameters()          # an nn.Module passed where its parameters were traced
        if not isinstance(x, dict):
            raise InputError(f"{_where(path)}: expected a dict with keys {keys}, got {_kind(x)}")
        given = {str(k): v for k, v in x.items()}
        missing, extra = [k for k in keys if k not in given], sorted(set(given) - set(keys))
        if missing or extra:
            raise InputError(f"{_where(path)}: the dict's keys do not match the compiled ones: missing "
                             f"{missing}, unexpected {extra}", hint=f"pass exactly the keys {keys}")
        for k, c in zip(keys, children):
            _match(c, given[k], f"{path}.{k}" if path else k, out, sig)
        return
    raise InputError(f"the compiled signature has an unknown tree node {kind!r}")
