"""nn.Module: parameters as attributes, found by walking the module tree.

`module.parameters()` is an ordered name -> array dict (`{"fc1.weight": ..., ...}`).
Tracing swaps the arrays for traced values (constants when the module is compiled,
inputs when a function takes the module as an argument) and puts them back after.
`module.freeze(...)` takes arrays out of `parameters()` without taking them out of the
forward (PyTorch's `requires_grad_(False)`).

Buffers (`register_buffer`: BatchNorm's running statistics) are arrays the forward reads
and, in training mode, replaces (`update_buffer`); they are not parameters. Eagerly the
new value is stored at once, as in PyTorch. A traced forward stores it only inside a
compiled training step (`buffer_updates()`, which tc.compile_train_step opens: the
step takes the buffers as inputs and returns their new values); any other trace (tc.compile,
tc.grad) leaves them as they were, so no traced value outlives its trace.
`module.train()` / `module.eval()` set `training` on the module and its children.
"""
from __future__ import annotations

import contextlib
import contextvars
import fnmatch

import numpy as np

from .. import pytree
from ..errors import ConfigError, InputError
from ..tracing.tracer import Tracer


def _is_param(v):
    return isinstance(v, (np.ndarray, Tracer))


_UPDATING_BUFFERS: contextvars.ContextVar = contextvars.ContextVar("tercomp_buffer_updates",
                                                                   default=False)


@contextlib.contextmanager
def buffer_updates():
    """While open, a traced forward's `update_buffer` stores its traced value on the
    module (the caller reads them with `buffers()` and restores the arrays after)."""
    token = _UPDATING_BUFFERS.set(True)
    try:
        yield
    finally:
        _UPDATING_BUFFERS.reset(token)


class Module:
    """Base class of layers and models. Subclasses define `forward`."""

    training = True      # train() / eval(); instances set their own

    def train(self, mode: bool = True) -> "Module":
        """Training mode (the default): BatchNorm uses batch statistics and updates its
        running ones. Sets it on every child; returns the module."""
        self.training = bool(mode)
        for _, m in self._children():
            m.train(mode)
        return self

    def eval(self) -> "Module":
        """Evaluation mode: BatchNorm uses its running statistics."""
        return self.train(False)

    def register_buffer(self, name: str, value) -> None:
        """Keep the array `value` as attribute `name`: read by the forward, saved in
        `buffers()`, not a parameter (no gradient, no optimizer update)."""
        setattr(self, name, np.asarray(value))
        self._buffer_names = frozenset(vars(self).get("_buffer_names", ())) | {name}

    def update_buffer(self, name: str, value) -> None:
        """Replace buffer `name` with `value`, computed by the forward in training mode
        (see the module docstring for when a traced value is kept)."""
        if name not in vars(self).get("_buffer_names", ()):
            raise InputError(f"{type(self).__name__} has no buffer {name!r}",
                             hint="register it first with self.register_buffer(name, array)")
        if isinstance(value, Tracer) and not _UPDATING_BUFFERS.get():
            return
        setattr(self, name, value)

    def buffers(self) -> dict:
        """Ordered dict name -> array of every buffer, nested modules included."""
        out = {k: getattr(self, k) for k in sorted(vars(self).get("_buffer_names", ()))}
        for prefix, m in self._children():
            for n, v in m.buffers().items():
                out[f"{prefix}.{n}"] = v
        return out

    def load_buffers(self, values: dict) -> None:
        """Set buffers by dotted name (names and shapes must be the module's)."""
        own = self.buffers()
        for k, v in values.items():
            if k not in own:
                raise InputError(f"{type(self).__name__} has no buffer {k!r}",
                                 hint=f"its buffers are {list(own) or 'none'}")
            if tuple(np.shape(v)) != tuple(np.shape(own[k])):
                raise InputError(f"buffer {k}: shape {tuple(np.shape(v))}, the model has "
                                 f"{tuple(np.shape(own[k]))}")
        self._load_params(values)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} must define forward()")

    def _children(self):
        for k, v in vars(self).items():
            if k.startswith("_"):
                continue
            if isinstance(v, Module):
                yield k, v
            elif isinstance(v, (list, tuple)) and v and all(isinstance(m, Module) for m in v):
                for i, m in enumerate(v):
                    yield f"{k}.{i}", m

    def parameters(self) -> dict:
        """Ordered dict name -> array of every parameter, nested modules included
        (frozen arrays are not parameters: see `freeze`)."""
        out = {}
        frozen = frozenset(vars(self).get("_frozen", ())) | vars(self).get("_buffer_names", frozenset())
        for k, v in vars(self).items():
            if not k.startswith("_") and _is_param(v) and k not in frozen:
                out[k] = v
        for prefix, m in self._children():
            for n, v in m.parameters().items():
                out[f"{prefix}.{n}"] = v
        return out

    def freeze(self, which) -> list:
        """Keep the parameters `which` selects fixed, as setting `requires_grad = False`
        on them does in PyTorch; returns their names.

        `which` is a glob pattern (fnmatch) or a list of them, each matched against a
        parameter's dotted name and every prefix of it ("embed_tokens" and "layers.0"
        select whole modules, "*norm*" every norm), or a predicate `name -> bool`. A
        frozen array stays where it is and the forward reads it (a constant when
        traced), but it leaves `parameters()`: `tc.grad`, `tc.compile_train_step`,
        `state_dict()` and checkpoints no longer see it, so training leaves it
        bit-identical. A pattern that selects nothing is an error (a typo would
        otherwise train everything).

        >>> model.freeze(["embed_tokens", "layers.0.*"])
        ['embed_tokens.weight', 'layers.0.input_layernorm.weight', ...]
        """
        names = select(list(self.parameters()), which, "freeze")
        for name in names:
            *path, leaf = name.split(".")
            owner = self
            for p in path:
                owner = owner[int(p)] if isinstance(owner, (list, tuple)) else getattr(owner, p)
            owner._frozen = frozenset(vars(owner).get("_frozen", ())) | {leaf}
        return names

    def _load_params(self, values: dict):
        """Set parameters by dotted name (used by tracing and load_state_dict)."""
        for name, v in values.items():
            obj = self
            *path, leaf = name.split(".")
            for p in path:
                obj = obj[int(p)] if isinstance(obj, (list, tuple)) else getattr(obj, p)
            setattr(obj, leaf, v)

    def state_dict(self) -> dict:
        """A copy of the parameters as NumPy arrays."""
        return {k: np.array(v) for k, v in self.parameters().items()}

    def load_state_dict(self, state: dict, strict: bool = True):
        """Load parameters; names and shapes must match (TercompError otherwise)."""
        own = self.parameters()
        missing = [k for k in own if k not in state]
        extra = [k for k in state if k not in own]
        if strict and (missing or extra):
            raise InputError(f"state dict does not match {type(self).__name__}: "
                             f"missing {missing}, unexpected {extra}")
        vals = {}
        for k, v in state.items():
            if k not in own:
                continue
            v = np.asarray(v)
            if v.shape != np.shape(own[k]):
                raise InputError(f"parameter {k}: shape {v.shape} in the state dict, "
                                 f"{np.shape(own[k])} in the model")
            vals[k] = v.astype(np.asarray(own[k]).dtype)
        self._load_params(vals)

    def __repr__(self):
        params = ", ".join(f"{k}{tuple(np.shape(v))}" for k, v in self.parameters().items())
        return f"{type(self).__name__}({params})"


def select(names: list, which, what: str = "select") -> list:
    """The names (in order) that `which` selects: a glob pattern or a list of them,
    matched against a dotted name and each of its prefixes, or a predicate name -> bool
    (see Module.freeze). A pattern that matches no name is a TercompError."""
    if callable(which):
        return [n for n in names if which(n)]
    patterns = [which] if isinstance(which, str) else list(which) \
        if isinstance(which, (list, tuple, set, frozenset)) else None
    if patterns is None or not all(isinstance(p, str) for p in patterns):
        raise ConfigError(f"{what}: expected a name pattern, a list of them or a predicate "
                          f"name -> bool, got {which!r:.80}")

    def prefixes(n):
        parts = n.split(".")
        return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    chosen = set()
    for p in patterns:
        hit = {n for n in names if any(fnmatch.fnmatchcase(q, p) for q in prefixes(n))}
        if not hit:
            raise ConfigError(f"{what}: pattern {p!r} matches no parameter",
                              hint=f"parameter names look like {', '.join(names[:3])}")
        chosen |= hit
    return [n for n in names if n in chosen]


pytree.register_module_class(Module)     # flattened to its parameters
