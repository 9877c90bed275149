"""Selective state-space layers (Mamba S6) built on tc.scan / tc.associative_scan.

SelectiveSSM maps x [B, L, D] to y [B, L, D] with a diagonal state of N numbers per
channel and input-dependent step size and projections:

    delta_t = softplus(dt_proj(x_proj_dt(x_t)))          [B, D]   (dt_rank bottleneck)
    B_t, C_t = x_proj_B(x_t), x_proj_C(x_t)              [B, N]
    A = -exp(A_log)                                      [D, N]
    h_t = exp(delta_t A) * h_{t-1} + delta_t B_t x_t     [B, D, N]  (zero-order hold on A,
                                                                     Euler on B, as Mamba)
    y_t = h_t . C_t + D * x_t

`mode="scan"` runs the recurrence as one tern.scan (any length, symbolic too);
`mode="associative"` as a log-depth tc.associative_scan over the linear recurrence
(static lengths); `mode="auto"` (the default) takes the associative form for a static
length and the scan for a symbolic one. bench/scan.py measured a MambaBlock gradient
step (B=4, T=64, d_inner=64, N=16) on the 2-core VM at 16 ms associative against 53 ms
scan (compile 29 s against 19 s): a scan step is a host-side loop iteration of a few
dispatches. MambaBlock wraps it as the reference Mamba block (mamba_simple.py) does:
RMSNorm, a BitLinear in-projection to (x, z), a causal depthwise Conv1d over time
(kernel d_conv = 4, with bias) and SiLU, the SSM, a SiLU(z) gate, a BitLinear
out-projection and a residual connection.
"""
from __future__ import annotations

import numpy as np

from ..errors import TraceError, ConfigError
from ..tracing import api as _t
from ..tracing.control_flow import associative_scan, scan
from .bitlinear import BitLinear
from .conv import Conv1d
from .layers import Linear, RMSNorm, _rng
from .module import Module

MODES = ("auto", "scan", "associative")


def softplus(x):
    """log(1 + exp(x)), without overflow for large x."""
    return _t.maximum(x, 0.0) + _t.log(1.0 + _t.exp(-_t.abs(x)))


def _linear_recurrence(a, b):
    """Composition of the maps h -> a h + b (associative): the first, then the second."""
    (a1, b1), (a2, b2) = a, b
    return a1 * a2, a2 * b1 + b2


class SelectiveSSM(Module):
    """Mamba's S6 layer over x [B, L, d_inner] -> [B, L, d_inner].

    >>> ssm = nn.SelectiveSSM(64, d_state=16)
    >>> y = ssm(x)                       # x: [B, L, 64], L may be symbolic
    """

    def __init__(self, d_inner: int, d_state: int = 16, dt_rank: int | None = None,
                 mode: str = "auto", dt_min: float = 1e-3, dt_max: float = 0.1, dtype="float32"):
        if mode not in MODES:
            raise ConfigError(f"SelectiveSSM: mode must be one of {MODES}, got {mode!r}")
        for name, v in (("d_inner", d_inner), ("d_state", d_state)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
                raise ConfigError(f"SelectiveSSM: {name} must be a positive int, got {v!r}")
        self.d_inner, self.d_state, self.mode = int(d_inner), int(d_state), mode
        self.dt_rank = int(dt_rank or max(1, -(-d_inner // 16)))
        self.x_proj = Linear(self.d_inner, self.dt_rank + 2 * self.d_state, bias=False, dtype=dtype)
        self.dt_proj = Linear(self.dt_rank, self.d_inner, bias=True, dtype=dtype)
        # Mamba's init: dt in [dt_min, dt_max] log-uniformly through the softplus inverse
        dt = np.exp(_rng.uniform(np.log(dt_min), np.log(dt_max), self.d_inner))
        self.dt_proj.bias = (dt + np.log(-np.expm1(-dt))).astype(dtype)
        self.A_log = np.log(np.tile(np.arange(1, self.d_state + 1, dtype=np.float64),
                                    (self.d_inner, 1))).astype(dtype)
        self.D = np.ones(self.d_inner, dtype)

    def forward(self, x):
        shape = tuple(x.shape) if hasattr(x, "shape") else np.shape(x)
        if len(shape) != 3 or shape[-1] != self.d_inner:
            raise TraceError(f"SelectiveSSM({self.d_inner}) takes x of shape [B, L, {self.d_inner}], "
                             f"got {list(shape)}")
        r, n = self.dt_rank, self.d_state
        proj = self.x_proj(x)                                        # [B, L, r + 2n]
        delta = softplus(self.dt_proj(proj[:, :, :r]))               # [B, L, D]
        Bm, Cm = proj[:, :, r:r + n], proj[:, :, r + n:]             # [B, L, N]
        A = -_t.exp(self.A_log)                                      # [D, N]
        tm = [_t.transpose(v, (1, 0, 2)) for v in (x, delta, Bm, Cm)]   # time-major [L, B, .]
        mode = self.mode
        if mode == "auto":
            mode = "associative" if isinstance(shape[1], (int, np.integer)) else "scan"
        if mode == "scan":
            y = self._scan(A, *tm)
        else:
            y = self._associative(A, *tm)
        return _t.transpose(y, (1, 0, 2))

    def _scan(self, A, x, delta, Bm, Cm):
        h0 = _t.broadcast_to(_t.expand_dims(_t.sum(x, axis=0) * 0.0, -1),
                             (x.shape[1], self.d_inner, self.d_state))   # zeros [B, D, N]

        def step(h, s):
            dt = _t.expand_dims(s["delta"], -1)                      # [B, D, 1]
            h = _t.exp(dt * A) * h + dt * _t.expand_dims(s["B"], 1) * _t.expand_dims(s["x"], -1)
            y = _t.sum(h * _t.expand_dims(s["C"], 1), axis=-1) + self.D * s["x"]
            return h, y
        _, ys = scan(step, h0, {"x": x, "delta": delta, "B": Bm, "C": Cm})
        return ys

    def _associative(self, A, x, delta, Bm, Cm):
        dt = _t.expand_dims(delta, -1)                               # [L, B, D, 1]
        dA = _t.exp(dt * A)
        dBx = dt * _t.expand_dims(Bm, 2) * _t.expand_dims(x, -1)     # [L, B, D, N]
        _, h = associative_scan(_linear_recurrence, (dA, dBx))
        return _t.sum(h * _t.expand_dims(Cm, 2), axis=-1) + self.D * x


class MambaBlock(Module):
    """x + out_proj(SSM(silu(conv1d(in_x))) * silu(z)), (in_x, z) = in_proj(RMSNorm(x)),
    with BitLinear (ternary) in and out projections and Mamba's causal depthwise conv1d
    (`conv1d.weight` [d_inner, 1, d_conv], `conv1d.bias`: position t sees t - d_conv + 1
    .. t). x: [B, L, d_model], L may be symbolic."""

    def __init__(self, d_model: int, d_inner: int | None = None, d_state: int = 16,
                 dt_rank: int | None = None, mode: str = "auto", d_conv: int = 4, dtype="float32"):
        self.d_model = int(d_model)
        self.d_inner = int(d_inner or 2 * d_model)
        self.norm = RMSNorm(self.d_model, dtype=dtype)
        self.in_proj = BitLinear(self.d_model, 2 * self.d_inner, dtype=dtype)
        # causal: d_conv - 1 zeros before the sequence, none after
        self.conv1d = Conv1d(self.d_inner, self.d_inner, d_conv, padding=[(d_conv - 1, 0)],
                             groups=self.d_inner, bias=True, dtype=dtype)
        self.ssm = SelectiveSSM(self.d_inner, d_state, dt_rank, mode=mode, dtype=dtype)
        self.out_proj = BitLinear(self.d_inner, self.d_model, dtype=dtype)

    def forward(self, x):
        u = self.in_proj(self.norm(x))
        xi, z = u[:, :, :self.d_inner], u[:, :, self.d_inner:]
        xc = _t.transpose(self.conv1d(_t.transpose(xi, (0, 2, 1))), (0, 2, 1))   # over time
        y = self.ssm(_t.silu(xc)) * _t.silu(z)
        return x + self.out_proj(y)
