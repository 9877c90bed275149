"""Pytrees (a leaf module: imports only tercomp.errors, shared by tracing and the runtime): nested tuples, lists and dicts (and nn.Modules) whose leaves are arrays.

A treedef is plain JSON-able data so that saved artifacts can rebuild result trees:
`None` (a leaf), `["tuple", [..]]`, `["list", [..]]`, `["dict", [keys], [..]]`,
`["none"]`. Modules flatten to their parameters (treedef `["module", [names], id]`,
which is not JSON-able: modules are never artifact outputs).
"""
from __future__ import annotations

from .errors import InputError

_MODULE_BASES: list = []        # classes registered with register_module_class
_MODULE_TYPES: dict = {}        # type -> whether it is one of them (a cache)


def register_module_class(cls) -> None:
    """Flatten instances of `cls` and its subclasses as modules (to their parameters),
    like JAX's register_pytree_node for a family of classes. tercomp.nn registers its
    Module when it is imported: this module never imports nn (the runtime uses it
    without the compiler)."""
    _MODULE_BASES.append(cls)
    _MODULE_TYPES.clear()


def is_module(x) -> bool:
    """Whether `x` is an instance of a class registered with register_module_class."""
    t = type(x)
    hit = _MODULE_TYPES.get(t)
    if hit is None:
        hit = _MODULE_TYPES[t] = bool(_MODULE_BASES) and issubclass(t, tuple(_MODULE_BASES))
    return hit


def flatten(tree, path="", is_leaf=None):
    """Returns (leaves, paths, treedef); paths are dotted names like 'params.w' or 'batch.0'."""
    leaves, paths = [], []

    def rec(x, p):
        if is_leaf is not None and is_leaf(x):
            leaves.append(x)
            paths.append(p)
            return None
        if x is None:
            return ["none"]
        if isinstance(x, tuple) and not hasattr(x, "_fields"):
            return ["tuple", [rec(c, f"{p}.{i}" if p else str(i)) for i, c in enumerate(x)]]
        if isinstance(x, list):
            return ["list", [rec(c, f"{p}.{i}" if p else str(i)) for i, c in enumerate(x)]]
        if isinstance(x, dict):
            keys = sorted(x, key=str)
            return ["dict", [str(k) for k in keys], [rec(x[k], f"{p}.{k}" if p else str(k)) for k in keys]]
        if is_module(x):
            params = x.parameters()
            names = list(params)
            for n in names:
                leaves.append(params[n])
                paths.append(f"{p}.{n}" if p else n)
            return ["module", names, x]
        leaves.append(x)
        paths.append(p)
        return None

    treedef = rec(tree, path)
    return leaves, paths, treedef


def unflatten(treedef, leaves, on_module=None):
    """Rebuild a tree. A module node becomes `on_module(module, {name: leaf})`, or a
    dict of its parameters by name (how grads with respect to a module come back)."""
    it = iter(leaves)

    def rec(t):
        if t is None:
            return next(it)
        kind = t[0]
        if kind == "none":
            return None
        if kind == "tuple":
            return tuple(rec(c) for c in t[1])
        if kind == "list":
            return [rec(c) for c in t[1]]
        if kind == "dict":
            return {k: rec(c) for k, c in zip(t[1], t[2])}
        if kind == "module":
            vals = {n: next(it) for n in t[1]}
            return on_module(t[2], vals) if on_module else vals
        raise InputError(f"bad treedef {t!r}")

    out = rec(treedef)
    rest = list(it)
    if rest:
        raise InputError(f"{len(rest)} leaves left over when unflattening")
    return out


def num_leaves(treedef) -> int:
    if treedef is None:
        return 1
    kind = treedef[0]
    if kind == "none":
        return 0
    if kind == "module":
        return len(treedef[1])
    children = treedef[2] if kind == "dict" else treedef[1]
    return sum(num_leaves(c) for c in children)


def jsonable(treedef):
    """Treedef without module references (modules become dicts of their parameters)."""
    if treedef is None:
        return None
    if treedef[0] == "module":
        return ["dict", list(treedef[1]), [None] * len(treedef[1])]
    if treedef[0] == "dict":
        return ["dict", treedef[1], [jsonable(c) for c in treedef[2]]]
    if treedef[0] in ("tuple", "list"):
        return [treedef[0], [jsonable(c) for c in treedef[1]]]
    return treedef


def tree_map(fn, *trees):
    """fn over the leaves of trees of one structure, as a tree like trees[0] (JAX's
    tree_map); trees with different leaf counts are a TercompError."""
    first, _, treedef = flatten(trees[0])
    others = [flatten(t)[0] for t in trees[1:]]
    for o in others:
        if len(o) != len(first):
            raise InputError(f"pytrees do not match: {len(first)} leaves and {len(o)} leaves",
                             hint="grads, params and optimizer state must have the same structure")
    return unflatten(treedef, [fn(*xs) for xs in zip(first, *others)])
