"""nn.Module: parameters as attributes, found by walking the module tree.

`module.parameters()` is an ordered name -> array dict (`{"fc1.weight": ..., ...}`).
Tracing swaps the arrays for traced values (constants when the module is compiled,
inputs when a function takes the module as an argument) and puts them back after.
"""
from __future__ import annotations

import numpy as np

from .. import pytree
from ..errors import TercompError
from ..trace.tracer import Tracer


def _is_param(v):
    return isinstance(v, (np.ndarray, Tracer))


class Module:
    """Base class of layers and models. Subclasses define `forward`."""

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
        """Ordered dict name -> array of every parameter, nested modules included."""
        out = {}
        for k, v in vars(self).items():
            if not k.startswith("_") and _is_param(v):
                out[k] = v
        for prefix, m in self._children():
            for n, v in m.parameters().items():
                out[f"{prefix}.{n}"] = v
        return out

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
            raise TercompError(f"state dict does not match {type(self).__name__}: "
                               f"missing {missing}, unexpected {extra}")
        vals = {}
        for k, v in state.items():
            if k not in own:
                continue
            v = np.asarray(v)
            if v.shape != np.shape(own[k]):
                raise TercompError(f"parameter {k}: shape {v.shape} in the state dict, "
                                   f"{np.shape(own[k])} in the model")
            vals[k] = v.astype(np.asarray(own[k]).dtype)
        self._load_params(vals)

    def __repr__(self):
        params = ", ".join(f"{k}{tuple(np.shape(v))}" for k, v in self.parameters().items())
        return f"{type(self).__name__}({params})"


pytree.register_module_class(Module)     # flattened to its parameters
