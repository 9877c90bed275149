"""Standard layers: Linear, LayerNorm, RMSNorm, Embedding (PyTorch conventions)."""
from __future__ import annotations

import numpy as np

from ..tracing import api as _t
from ..errors import ConfigError
from .module import Module

_rng = np.random.default_rng(0)


def manual_seed(seed: int):
    """Seed the generator that initializes new layers."""
    global _rng
    _rng = np.random.default_rng(seed)


def _uniform(shape, bound, dtype):
    return _rng.uniform(-bound, bound, size=shape).astype(dtype)


class Linear(Module):
    """y = x @ weight.T + bias, weight of shape (out_features, in_features)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype="float32"):
        if in_features <= 0 or out_features <= 0:
            raise ConfigError(f"Linear({in_features}, {out_features}): sizes must be positive")
        bound = 1.0 / np.sqrt(in_features)
        self.in_features, self.out_features = in_features, out_features
        self.weight = _uniform((out_features, in_features), bound, dtype)
        self.bias = _uniform((out_features,), bound, dtype) if bias else None

    def forward(self, x):
        y = _t.matmul(x, self.weight, transpose_b=True)
        return y + self.bias if self.bias is not None else y


class LayerNorm(Module):
    def __init__(self, dim: int, eps: float = 1e-5, dtype="float32"):
        self.eps = eps
        self.weight = np.ones(dim, dtype)
        self.bias = np.zeros(dim, dtype)

    def forward(self, x):
        return _t.layer_norm(x, self.weight, self.bias, eps=self.eps)


class RMSNorm(Module):
    def __init__(self, dim: int, eps: float = 1e-6, dtype="float32"):
        self.eps = eps
        self.weight = np.ones(dim, dtype)

    def forward(self, x):
        return _t.rms_norm(x, self.weight, eps=self.eps)


class Embedding(Module):
    """Lookup table of shape (num_embeddings, dim); call with integer ids."""

    def __init__(self, num_embeddings: int, dim: int, dtype="float32"):
        self.weight = _rng.standard_normal((num_embeddings, dim)).astype(dtype)

    def forward(self, ids):
        return _t.take(self.weight, ids, axis=0)
