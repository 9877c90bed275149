"""Convolutional layers with PyTorch's conventions: Conv1d/2d/3d, BatchNorm1d/2d,
MaxPool2d, AvgPool2d, Flatten.

Weights are laid out as PyTorch's ([out, in // groups, *kernel]) and initialized as its
defaults (uniform in +-1/sqrt(fan_in)), so a state dict moves between the two.
BatchNorm keeps `running_mean` / `running_var` as buffers (nn.Module.register_buffer):
in training mode it normalizes by the batch's statistics and updates the running ones
(momentum 0.1, the unbiased variance, as PyTorch), in eval mode (`model.eval()`) it
normalizes by the running ones. A compiled training step (tc.compile_train_step)
updates them on the device; `step.sync_to(model)` copies them back with the weights.
SyncBatchNorm (syncbn.py) is BatchNorm over every rank's shard in a data-parallel step.
"""
from __future__ import annotations

import numpy as np

from ..errors import TraceError, ConfigError
from ..tracing import api as _t
from ..tracing.conv_api import PADDING_HINT
from ..tracing.tracer import apply
from .layers import _uniform
from .module import Module


def _shape(x):
    return tuple(getattr(x, "shape", np.shape(x)))


def _check_rank(layer, x, ranks, layout):
    shape = _shape(x)
    if len(shape) not in ranks:
        raise TraceError(f"{layer} expects an input {layout}, got shape {list(shape)}")
    return shape


def _tuple(v, nd, name, layer):
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        return (int(v),) * nd
    if isinstance(v, (list, tuple)) and len(v) == nd:
        return tuple(v)
    raise ConfigError(f"{layer}: {name} must be an int or {nd} ints, got {v!r}")


def _check_channels(layer, in_channels, out_channels, groups):
    for what, v in (("in_channels", in_channels), ("out_channels", out_channels), ("groups", groups)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
            raise ConfigError(f"{layer}: {what} must be a positive int, got {v!r}")
    if in_channels % groups or out_channels % groups:
        raise ConfigError(f"{layer}: groups={groups} must divide in_channels={in_channels} and "
                          f"out_channels={out_channels}")


class _ConvNd(Module):
    nd = 0

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0,
                 dilation=1, groups=1, bias=True, dtype="float32"):
        name = type(self).__name__
        _check_channels(name, in_channels, out_channels, groups)
        kernel = _tuple(kernel_size, self.nd, "kernel_size", name)
        if not all(isinstance(k, (int, np.integer)) and k > 0 for k in kernel):
            raise ConfigError(f"{name}: kernel_size must be positive, got {kernel_size!r}")
        self.in_channels, self.out_channels, self.groups = int(in_channels), int(out_channels), int(groups)
        if isinstance(padding, str) and padding not in ("same", "valid"):
            raise ConfigError(f"{name}: padding must be \"same\" or \"valid\" when it is a "
                              f"string, got {padding!r}", hint=PADDING_HINT)
        self.kernel_size, self.stride, self.padding, self.dilation = kernel, stride, padding, dilation
        fan_in = in_channels // groups * int(np.prod(kernel))
        bound = 1.0 / np.sqrt(fan_in)
        self.weight = _uniform((out_channels, in_channels // groups) + kernel, bound, dtype)
        self.bias = _uniform((out_channels,), bound, dtype) if bias else None

    def forward(self, x):
        _check_rank(type(self).__name__, x, (self.nd + 2,), f"[N, C, {self._layout()}]")
        y = _t.conv(x, self.weight, stride=self.stride, padding=self.padding,
                    dilation=self.dilation, groups=self.groups)
        if self.bias is None:
            return y
        return y + _t.reshape(self.bias, (self.out_channels,) + (1,) * self.nd)

    def _layout(self):
        return ", ".join(["L"] if self.nd == 1 else ["H", "W"] if self.nd == 2 else ["D", "H", "W"])


class Conv1d(_ConvNd):
    """1-D convolution over x [N, C, L]; weight [out, in // groups, k] (PyTorch's
    nn.Conv1d). `padding`: an int, "same" or "valid".

    >>> conv = nn.Conv1d(4, 8, 3, padding="same")
    >>> conv(np.ones((2, 4, 10), np.float32)).shape
    (2, 8, 10)
    """
    nd = 1


class Conv2d(_ConvNd):
    """2-D convolution over x [N, C, H, W]; weight [out, in // groups, kh, kw]
    (PyTorch's nn.Conv2d: stride, padding (int, pair, "same", "valid"), dilation, groups,
    bias)."""
    nd = 2


class Conv3d(_ConvNd):
    """3-D convolution over x [N, C, D, H, W]; weight [out, in // groups, kd, kh, kw]."""
    nd = 3


class _BatchNorm(Module):
    ranks: tuple = ()
    layout = ""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1,
                 affine: bool = True, dtype="float32"):
        name = type(self).__name__
        if isinstance(num_features, bool) or not isinstance(num_features, (int, np.integer)) \
                or num_features <= 0:
            raise ConfigError(f"{name}: num_features must be a positive int, got {num_features!r}")
        if not 0.0 <= float(momentum) <= 1.0:
            raise ConfigError(f"{name}: momentum must be in [0, 1], got {momentum!r}")
        self.num_features, self.eps, self.momentum = int(num_features), float(eps), float(momentum)
        self.weight = np.ones(num_features, dtype) if affine else None
        self.bias = np.zeros(num_features, dtype) if affine else None
        self.register_buffer("running_mean", np.zeros(num_features, dtype))
        self.register_buffer("running_var", np.ones(num_features, dtype))

    def forward(self, x):
        shape = self._check(x)
        axes = [0] + list(range(2, len(shape)))
        if self.training:
            mean = _t.mean(x, axis=axes, keepdims=True)
            var = _t.mean(_t.square(x - mean), axis=axes, keepdims=True)
            self._update_running(mean, var, apply("size", x, axes=axes))
        else:
            mean, var = self._channels(self.running_mean, x), self._channels(self.running_var, x)
        return self._normalize(x, mean, var)

    def _check(self, x):
        name = type(self).__name__
        shape = _check_rank(name, x, self.ranks, self.layout)
        if shape[1] != self.num_features:
            raise TraceError(f"{name}({self.num_features}) got an input of shape {list(shape)} "
                             f"with {shape[1]} channels")
        return shape

    def _channels(self, v, x):
        """A per-channel vector shaped to broadcast against x [N, C, *spatial]."""
        return _t.reshape(v, (self.num_features,) + (1,) * (len(_shape(x)) - 2))

    def _normalize(self, x, mean, var):
        y = (x - mean) * _t.rsqrt(var + self.eps)
        if self.weight is not None:
            y = y * self._channels(self.weight, x) + self._channels(self.bias, x)
        return y

    def _update_running(self, mean, var, n):
        """running = (1 - momentum) * running + momentum * batch statistic, with the
        unbiased variance (n / (n - 1), n values a channel: a traced value when the batch
        is symbolic); no gradient flows into the buffers."""
        m, c = self.momentum, (self.num_features,)
        mean = _t.stop_gradient(_t.reshape(mean, c))
        var = _t.stop_gradient(_t.reshape(var, c)) * n / _t.maximum(n - 1.0, 1.0)
        self.update_buffer("running_mean", self.running_mean * (1.0 - m) + mean * m)
        self.update_buffer("running_var", self.running_var * (1.0 - m) + var * m)


class BatchNorm1d(_BatchNorm):
    """Batch normalization over x [N, C] or [N, C, L], per channel (PyTorch's
    nn.BatchNorm1d: eps, momentum, affine; running statistics as buffers)."""
    ranks = (2, 3)
    layout = "[N, C] or [N, C, L]"


class BatchNorm2d(_BatchNorm):
    """Batch normalization over x [N, C, H, W], per channel (PyTorch's nn.BatchNorm2d).

    >>> bn = nn.BatchNorm2d(3)
    >>> y = bn(x)                  # training: batch statistics; updates bn.running_mean
    >>> bn.eval(); y = bn(x)       # eval: the running statistics
    """
    ranks = (4,)
    layout = "[N, C, H, W]"


class _Pool2d(Module):
    fn = None

    def __init__(self, kernel_size, stride=None, padding=0):
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding

    def forward(self, x):
        _check_rank(type(self).__name__, x, (4,), "[N, C, H, W]")
        return type(self).fn(x, self.kernel_size, self.stride, self.padding)


class MaxPool2d(_Pool2d):
    """Max pooling over x [N, C, H, W] (PyTorch's nn.MaxPool2d: stride defaults to the
    kernel size, padding at most half of it)."""
    fn = staticmethod(_t.max_pool)


class AvgPool2d(_Pool2d):
    """Average pooling over x [N, C, H, W] (PyTorch's nn.AvgPool2d, zero padding
    counted in the mean)."""
    fn = staticmethod(_t.avg_pool)


class Flatten(Module):
    """Flatten dims start_dim..end_dim into one (PyTorch's nn.Flatten: [N, C, H, W] ->
    [N, C * H * W] by default); a symbolic batch dim stays symbolic."""

    def __init__(self, start_dim: int = 1, end_dim: int = -1):
        self.start_dim, self.end_dim = start_dim, end_dim

    def forward(self, x):
        shape = _shape(x)
        r = len(shape)
        s, e = self.start_dim, self.end_dim
        if not (-r <= s < r and -r <= e < r) or s % r > e % r:
            raise TraceError(f"Flatten(start_dim={s}, end_dim={e}) does not fit an input of "
                             f"shape {list(shape)}")
        s, e = s % r, e % r
        inner = shape[s:e + 1]
        merged = int(np.prod(inner)) if all(isinstance(d, (int, np.integer)) for d in inner) else -1
        return _t.reshape(x, tuple(shape[:s]) + (merged,) + tuple(shape[e + 1:]))
