"""SyncBatchNorm: batch normalization whose training statistics are those of the global
batch of a data-parallel step (PyTorch's nn.SyncBatchNorm).

Outside a data-parallel training step it is BatchNorm. Inside one
(tc.compile_train_step(..., data_parallel=True)), the step gives each SyncBatchNorm the
global sums of its input over every rank's shard (`SyncStatistics`): the sum, the sum of
squares about the running mean (a shift that keeps E[x^2] - E[x]^2 accurate) and the
count, per channel. The layer normalizes with the mean and variance of those sums and
records its rank's own sums, which the step sums over the ranks (the Allreduce). How the
step finds sums that depend on earlier layers' statistics, and the gradient through
them, without a collective inside the compiled forward: training/data_parallel.py.
"""
from __future__ import annotations

import contextvars

import numpy as np

from ..errors import TraceError
from ..tracing import api as _t
from ..tracing.tracer import apply
from .conv import _BatchNorm
from .module import Module

_SYNC: contextvars.ContextVar = contextvars.ContextVar("tercomp_sync_statistics", default=None)


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over x [N, C, *spatial] whose batch statistics, in a
    data-parallel training step, are those of every rank's examples together, with their
    gradient (PyTorch's nn.SyncBatchNorm); elsewhere (one process, eval mode) it is
    BatchNorm1d/2d. `SyncBatchNorm.convert_sync_batchnorm(model)` turns a model's
    BatchNorm layers into SyncBatchNorm.

    >>> model = nn.SyncBatchNorm.convert_sync_batchnorm(Net())
    >>> step = tc.compile_train_step(loss_fn, model, opt, xb, yb, data_parallel=True)
    """
    ranks = (2, 3, 4, 5)
    layout = "[N, C, *spatial]"

    def forward(self, x):
        sync = _SYNC.get()
        if not self.training or sync is None:
            return super().forward(x)
        return sync.normalize(self, x)

    @classmethod
    def convert_sync_batchnorm(cls, module: Module) -> Module:
        """`module` with every BatchNorm1d/2d in it (itself included) replaced by a
        SyncBatchNorm with the same weights, running statistics, eps, momentum and mode;
        changed in place (returned, as PyTorch's)."""
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            sync = cls.__new__(cls)
            vars(sync).update(vars(module))
            return sync
        for k, v in list(vars(module).items()):
            if k.startswith("_"):
                continue
            if isinstance(v, Module):
                setattr(module, k, cls.convert_sync_batchnorm(v))
            elif isinstance(v, (list, tuple)) and v and all(isinstance(m, Module) for m in v):
                setattr(module, k, type(v)(cls.convert_sync_batchnorm(m) for m in v))
        return module


def sync_layers(model: Module, prefix: str = "") -> list:
    """The model's SyncBatchNorm layers in training mode, in module order, as (dotted
    name, layer) pairs ("" for the model itself); a layer reachable twice counts once."""
    found = [(prefix, model)] if isinstance(model, SyncBatchNorm) and model.training else []
    for name, m in model._children():
        for pair in sync_layers(m, f"{prefix}.{name}" if prefix else name):
            if all(pair[1] is not f for _, f in found):
                found.append(pair)
    return found


def sums_size(layers) -> int:
    """The length of the vector of every layer's sums: sum, shifted sum of squares (C
    each) and count per layer."""
    return sum(2 * layer.num_features + 1 for layer in layers)


class SyncStatistics:
    """While open (a `with` block around a traced forward), each SyncBatchNorm in
    training mode normalizes with the statistics of `totals` (the global sums, a traced
    vector of sums_size(layers)) and records its input's sums; `local()` is the vector of
    the recorded sums, laid out as `totals` (zeros for a layer the forward did not call)."""

    def __init__(self, layers, totals):
        self.layers = list(layers)
        self.totals = totals
        self.offsets = np.cumsum([0] + [2 * m.num_features + 1 for m in self.layers]).tolist()
        self.local_sums = [None] * len(self.layers)

    def __enter__(self):
        self._token = _SYNC.set(self)
        return self

    def __exit__(self, *exc):
        _SYNC.reset(self._token)
        return False

    def normalize(self, layer, x):
        k = next((i for i, m in enumerate(self.layers) if m is layer), None)
        if k is None:
            raise TraceError("a SyncBatchNorm that is not part of the model ran in a "
                             "data-parallel training step",
                             hint="make every SyncBatchNorm an attribute of the model")
        if self.local_sums[k] is not None:
            raise TraceError(f"SyncBatchNorm({layer.num_features}) ran twice in one "
                             "data-parallel training step; each call's statistics must be "
                             "synchronized on their own",
                             hint="use one SyncBatchNorm for each place it is called")
        shape = layer._check(x)
        c = layer.num_features
        axes = [0] + list(range(2, len(shape)))
        # the running mean (the same on every rank) as the shift of the sum of squares
        shift = _t.stop_gradient(layer.running_mean)
        d = x - layer._channels(shift, x)
        n = apply("size", x, axes=axes)
        self.local_sums[k] = _t.concatenate([_t.sum(x, axis=axes), _t.sum(_t.square(d), axis=axes),
                                             _t.reshape(n, (1,))])
        t = self.totals[self.offsets[k]:self.offsets[k + 1]]
        count = t[2 * c:2 * c + 1]
        mean = t[:c] / count
        var = _t.maximum(t[c:2 * c] / count - _t.square(mean - shift), 0.0)
        layer._update_running(mean, var, _t.reshape(count, ()))
        return layer._normalize(x, layer._channels(mean, x), layer._channels(var, x))

    def local(self):
        parts = [s if s is not None else np.zeros(2 * m.num_features + 1, np.float32)
                 for s, m in zip(self.local_sums, self.layers)]
        return _t.concatenate(parts)
