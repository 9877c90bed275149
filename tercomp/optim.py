"""Optimizers, learning-rate schedules, gradient clipping and accumulation.

Everything here is a pure function of pytrees (dicts, tuples, lists of arrays), written
with tercomp's NumPy-named ops, so it runs eagerly on NumPy arrays and traces into a
compiled training step alike (see `tc.compile_train_step`):

    >>> opt = tc.optim.AdamW(lr=tc.optim.cosine(1e-3, total_steps=1000, warmup_steps=50))
    >>> state = opt.init(params)                       # {"step": 0.0, "mu": .., "nu": ..}
    >>> grads, norm = tc.optim.clip_by_global_norm(grads, 1.0)
    >>> params, state = opt.update(grads, state, params)

The step count is an f32 scalar inside the optimizer state (`state["step"]`, the number
of updates applied so far), so schedules are traced functions of it and one compiled
step serves the whole run. Semantics follow PyTorch's `torch.optim.SGD` (dampening 0)
and `torch.optim.AdamW`.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from .errors import TercompError, TraceError, ConfigError, InputError, check_number
from .tracing import api as _t
from . import pytree
from .pytree import tree_map
from .tracing.tracer import Tracer

__all__ = ["SGD", "AdamW", "Optimizer", "constant", "cosine", "Schedule",
           "global_norm", "clip_by_global_norm", "accumulate_gradients"]

# Largest finite f32: |x| <= F32_MAX is false exactly for NaN and +-Inf.
F32_MAX = float(np.finfo(np.float32).max)


# -- helpers ---------------------------------------------------------------------------
def _leaves(tree):
    leaves, _, treedef = pytree.flatten(tree)
    return leaves, treedef


def _scalar(x):
    """A number as an f32 scalar usable next to traced values (a 0-d array, never a
    Python float, so that ops whose first operand is a bool keep it f32)."""
    return x if isinstance(x, Tracer) else np.asarray(x, dtype=np.float32)


def _zeros_like(x):
    if isinstance(x, Tracer):
        return x * 0.0
    return np.zeros(np.shape(x), dtype=np.asarray(x).dtype)


# -- learning-rate schedules -----------------------------------------------------------
class Schedule:
    """A learning rate as a function of the step count (an f32 scalar, traced or not)."""

    def __call__(self, step):
        raise NotImplementedError


class constant(Schedule):
    """lr(step) = lr.

    >>> tc.optim.constant(0.1)(5.0)
    0.1
    """

    def __init__(self, lr):
        self.lr = check_number("optim.constant", "lr", lr, lo=0.0)

    def __call__(self, step):
        return self.lr

    def __repr__(self):
        return f"constant({self.lr})"


class cosine(Schedule):
    """Linear warmup to `peak_lr` over `warmup_steps`, then cosine decay to `final_lr`
    at `total_steps` (constant after). With step count t (updates done so far):

        t <  warmup: peak * (t + 1) / warmup
        t >= warmup: final + (peak - final) * (1 + cos(pi * min(1, (t - warmup) / (total - warmup)))) / 2

    >>> sched = tc.optim.cosine(1e-3, total_steps=1000, warmup_steps=100)
    >>> opt = tc.optim.AdamW(lr=sched)
    """

    def __init__(self, peak_lr, total_steps, warmup_steps=0, final_lr=0.0):
        self.peak_lr = check_number("optim.cosine", "peak_lr", peak_lr, lo=0.0)
        self.final_lr = check_number("optim.cosine", "final_lr", final_lr, lo=0.0)
        self.total_steps = check_number("optim.cosine", "total_steps", total_steps, lo=0.0, lo_open=True)
        self.warmup_steps = check_number("optim.cosine", "warmup_steps", warmup_steps, lo=0.0)
        if self.warmup_steps >= self.total_steps:
            raise ConfigError(f"optim.cosine: warmup_steps ({warmup_steps}) must be less than "
                              f"total_steps ({total_steps})")

    def __call__(self, step):
        t = _scalar(step)
        peak, final, warm = self.peak_lr, self.final_lr, self.warmup_steps
        u = _t.clip((t - warm) / (self.total_steps - warm), _scalar(0.0), _scalar(1.0))
        decayed = final + (peak - final) * 0.5 * (1.0 + _t.cos(u * math.pi))
        if warm == 0:
            return decayed
        warming = peak * (t + 1.0) / warm
        return _t.where(t < warm, _scalar(warming), _scalar(decayed))

    def __repr__(self):
        return (f"cosine(peak_lr={self.peak_lr}, total_steps={self.total_steps:g}, "
                f"warmup_steps={self.warmup_steps:g}, final_lr={self.final_lr})")


def _as_schedule(owner, lr) -> Schedule:
    if isinstance(lr, Schedule):
        return lr
    if callable(lr) and not isinstance(lr, numbers.Number):
        return _Callable(lr)
    try:
        return constant(lr)
    except TercompError:
        raise ConfigError(f"{owner}: the learning rate must be a non-negative number or a "
                          f"schedule (a function of the step count), got {lr!r} "
                          f"({type(lr).__name__})",
                          hint="e.g. lr=1e-3 or lr=tc.optim.cosine(1e-3, total_steps=1000)") from None


class _Callable(Schedule):
    def __init__(self, fn):
        self.fn = fn

    def __call__(self, step):
        return self.fn(step)


# -- gradient transforms ----------------------------------------------------------------
def global_norm(tree):
    """sqrt of the sum of squares of every leaf of `tree` (an f32 scalar)."""
    leaves, _ = _leaves(tree)
    if not leaves:
        raise InputError("global_norm of an empty pytree")
    total = None
    for g in leaves:
        s = _t.sum(g * g)
        total = s if total is None else total + s
    return _t.sqrt(total)


def clip_by_global_norm(grads, max_norm):
    """Scale `grads` so that their global norm is at most `max_norm` (all leaves by the
    same factor, max_norm / max(norm, max_norm)). Returns (clipped_grads, norm), the
    norm being that of the grads before clipping.

    >>> grads, norm = tc.optim.clip_by_global_norm(grads, 1.0)
    """
    max_norm = check_number("clip_by_global_norm", "max_norm", max_norm, lo=0.0, lo_open=True)
    norm = global_norm(grads)
    scale = max_norm / _t.maximum(norm, _scalar(max_norm))
    return tree_map(lambda g: g * scale, grads), norm


def accumulate_gradients(value_and_grad_fn, micro_batches: int):
    """Split every batch array along axis 0 into `micro_batches` equal slices, run
    `value_and_grad_fn(params, *micro_batch)` on each and return the mean of the values
    (and of a has_aux dict of metrics) and of the grads: for a mean-reduced loss this is
    the gradient of the whole batch, computed one micro-batch at a time.

    >>> vg = tc.optim.accumulate_gradients(tc.value_and_grad(loss), 4)
    >>> loss_value, grads = vg(params, x, y)          # x: (4 * m, ...)
    """
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, numbers.Integral) \
            or micro_batches < 1:
        raise ConfigError(f"accumulate_gradients: micro_batches must be a positive integer, "
                          f"got {micro_batches!r}")
    k = int(micro_batches)

    def fn(params, *batch):
        if k == 1:
            return value_and_grad_fn(params, *batch)
        leaves, treedef = _leaves(tuple(batch))
        slices = []
        for i, x in enumerate(leaves):
            shape = tuple(getattr(x, "shape", np.shape(x)))
            n = shape[0] if shape else None
            if not isinstance(n, (int, np.integer)):
                raise TraceError(f"gradient accumulation over {k} micro-batches needs batch "
                                 f"arrays with a static leading dim; batch leaf {i} has shape "
                                 f"{tuple(getattr(x, 'shape', ()))}",
                                 hint="compile with concrete example arrays, not a symbolic batch")
            if n % k:
                raise TraceError(f"gradient accumulation: the batch size {n} (batch leaf {i}) is "
                                 f"not divisible by {k} micro-batches")
            m = n // k
            slices.append([x[j * m:(j + 1) * m] for j in range(k)])
        value = grads = None
        for j in range(k):
            micro = pytree.unflatten(treedef, [s[j] for s in slices])
            v, g = value_and_grad_fn(params, *micro)
            value = v if value is None else tree_map(lambda a, b: a + b, value, v)
            grads = g if grads is None else tree_map(lambda a, b: a + b, grads, g)
        inv = 1.0 / k
        return tree_map(lambda a: a * inv, value), tree_map(lambda a: a * inv, grads)
    return fn


# -- optimizers -------------------------------------------------------------------------
class Optimizer:
    """Base class: `init(params) -> state`, `update(grads, state, params) -> (new_params,
    new_state)`, both pure. `state["step"]` is the f32 count of updates applied.

    `elementwise`: True when update() treats every element of every parameter alone
    (no per-tensor norms or shapes), so a compiled step may run it on all parameters
    packed in one vector (tercomp.training.packing); a subclass that looks at whole
    tensors leaves it False."""

    elementwise = False

    def init(self, params) -> dict:
        raise NotImplementedError

    def update(self, grads, state, params):
        raise NotImplementedError

    def learning_rate(self, step):
        """The learning rate at step count `step` (a number or a traced scalar)."""
        return self.lr(step)

    @staticmethod
    def _step(state):
        if not isinstance(state, dict) or "step" not in state:
            raise InputError("optimizer state must be the dict returned by init(params)")
        return state["step"]


class SGD(Optimizer):
    """Stochastic gradient descent with optional momentum, Nesterov momentum and (L2,
    coupled) weight decay, as torch.optim.SGD with dampening 0:

        g = grad + weight_decay * p
        buf = momentum * buf + g;  g = g + momentum * buf (nesterov) or buf
        p = p - lr(step) * g

    >>> opt = tc.optim.SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
    """

    elementwise = True

    def __init__(self, lr, momentum=0.0, nesterov=False, weight_decay=0.0):
        self.lr = _as_schedule("SGD", lr)
        self.momentum = check_number("SGD", "momentum", momentum, lo=0.0, hi=1.0, hi_open=True)
        self.weight_decay = check_number("SGD", "weight_decay", weight_decay, lo=0.0)
        if not isinstance(nesterov, bool):
            raise ConfigError(f"SGD: nesterov must be True or False, got {nesterov!r}")
        if nesterov and self.momentum == 0.0:
            raise ConfigError("SGD: nesterov=True needs a momentum > 0")
        self.nesterov = nesterov

    def init(self, params) -> dict:
        state = {"step": _scalar(0.0)}
        if self.momentum:
            state["momentum"] = tree_map(_zeros_like, params)
        return state

    def update(self, grads, state, params):
        step = self._step(state)
        lr = self.lr(step)
        wd, mom = self.weight_decay, self.momentum
        if wd:
            grads = tree_map(lambda g, p: g + wd * p, grads, params)
        new_state = {"step": step + 1.0}
        if mom:
            bufs = tree_map(lambda b, g: mom * b + g, state["momentum"], grads)
            new_state["momentum"] = bufs
            if self.nesterov:
                grads = tree_map(lambda g, b: g + mom * b, grads, bufs)
            else:
                grads = bufs
        new_params = tree_map(lambda p, g: p - lr * g, params, grads)
        return new_params, new_state

    def __repr__(self):
        return (f"SGD(lr={self.lr!r}, momentum={self.momentum}, nesterov={self.nesterov}, "
                f"weight_decay={self.weight_decay})")


class AdamW(Optimizer):
    """Adam with decoupled weight decay and bias correction, as torch.optim.AdamW:

        p = p * (1 - lr * weight_decay)
        m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
        p = p - lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps),   t = step + 1

    The corrections 1 - b^t are kept in the state (`corr1`, `corr2`, starting at 0) and
    advanced as corr' = (1 - b) + b * corr: at t = 1, 1 - b2^t is 1e-3, and computing it
    as 1 - (f32 power of b2) would lose four or five of its digits.

    >>> opt = tc.optim.AdamW(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01)
    """

    elementwise = True

    def __init__(self, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        self.lr = _as_schedule("AdamW", lr)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ConfigError(f"AdamW: betas must be a pair of numbers, got {betas!r}")
        self.b1 = check_number("AdamW", "betas[0]", betas[0], lo=0.0, hi=1.0, hi_open=True)
        self.b2 = check_number("AdamW", "betas[1]", betas[1], lo=0.0, hi=1.0, hi_open=True)
        self.eps = check_number("AdamW", "eps", eps, lo=0.0, lo_open=True)
        self.weight_decay = check_number("AdamW", "weight_decay", weight_decay, lo=0.0)

    def init(self, params) -> dict:
        return {"step": _scalar(0.0), "corr1": _scalar(0.0), "corr2": _scalar(0.0),
                "mu": tree_map(_zeros_like, params), "nu": tree_map(_zeros_like, params)}

    def update(self, grads, state, params):
        step = self._step(state)
        lr = self.lr(step)
        b1, b2, eps, wd = self.b1, self.b2, self.eps, self.weight_decay
        c1 = (1.0 - b1) + b1 * state["corr1"]
        c2 = (1.0 - b2) + b2 * state["corr2"]
        mu = tree_map(lambda m, g: b1 * m + (1.0 - b1) * g, state["mu"], grads)
        nu = tree_map(lambda v, g: b2 * v + (1.0 - b2) * (g * g), state["nu"], grads)

        def upd(p, m, v):
            if wd:
                p = p - (lr * wd) * p
            return p - lr * (m / c1) / (_t.sqrt(v / c2) + eps)
        new_params = tree_map(upd, params, mu, nu)
        return new_params, {"step": step + 1.0, "corr1": c1, "corr2": c2, "mu": mu, "nu": nu}

    def __repr__(self):
        return (f"AdamW(lr={self.lr!r}, betas=({self.b1}, {self.b2}), eps={self.eps}, "
                f"weight_decay={self.weight_decay})")
