"""Next-token sampling from logits: greedy, temperature, top-k, top-p (nucleus).

Pure NumPy on the host (the logits of one step are a [vocab] vector); the same
`np.random.Generator` state gives the same tokens.

    >>> rng = np.random.default_rng(0)
    >>> sample(np.array([0.0, 5.0, 1.0]), 0.0, None, None, rng)      # greedy
    1
"""
from __future__ import annotations

import numbers

import numpy as np

from ..errors import InputError

#: the most alternatives a request may ask log-probabilities of (OpenAI's top_logprobs)
MAX_LOGPROBS = 20


def check_sampling(temperature, top_k, top_p, seed) -> None:
    """InputError unless temperature >= 0, top_k None or >= 1, 0 < top_p <= 1 (or
    None) and seed an int."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) \
            or not np.isfinite(temperature) or temperature < 0:
        raise InputError(f"temperature must be a number >= 0, got {temperature!r}",
                         hint="0 is greedy decoding")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral)
                              or top_k < 1):
        raise InputError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, numbers.Real)
                              or not 0 < top_p <= 1):
        raise InputError(f"top_p must be None or a number in (0, 1], got {top_p!r}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise InputError(f"seed must be a non-negative int, got {seed!r}")


def probabilities(logits: np.ndarray, temperature: float, top_k=None, top_p=None) -> np.ndarray:
    """The distribution that `sample` draws from (float64, sums to 1). The logits are
    shifted by their maximum before the division by `temperature`, so a temperature
    as small as 1e-308 gives the limit distribution (the largest logits share the
    mass) instead of inf - inf = NaN."""
    z = np.asarray(logits, np.float64)
    with np.errstate(over="ignore"):        # (z - max) / T <= 0: overflow is -inf, exp 0
        z = (z - z.max()) / float(temperature)
    keep = np.ones(z.shape, bool)
    if top_k is not None and top_k < z.size:
        kth = np.partition(z, -int(top_k))[-int(top_k)]
        keep &= z >= kth
    z = np.where(keep, z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p is not None and top_p < 1:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        # the smallest prefix whose mass reaches top_p (always at least one token)
        n = int(np.searchsorted(cum, top_p) + 1)
        mask = np.zeros(p.shape, bool)
        mask[order[:n]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p


def sample(logits, temperature: float, top_k, top_p, rng: np.random.Generator) -> int:
    """One token id from `logits` [vocab]. temperature 0: argmax (the first on ties)."""
    logits = np.asarray(logits)
    if temperature == 0:
        return int(np.argmax(logits))
    p = probabilities(logits, temperature, top_k, top_p)
    return int(rng.choice(p.size, p=p))


def log_softmax(logits) -> np.ndarray:
    """log_softmax of `logits` [vocab] in float64 (the max subtracted first)."""
    z = np.asarray(logits, np.float64)
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def scored_token(logits, token: int, top: int) -> tuple:
    """(log-probability of `token`, the `top` most likely tokens as [(id,
    log-probability)], most likely first) under `logits` [vocab].

    >>> scored_token(np.log(np.array([0.5, 0.25, 0.25])), 1, 1)
    (-1.3862943611198906, [(0, -0.6931471805599453)])
    """
    lp = log_softmax(logits)
    best = []
    if top:
        k = min(int(top), lp.size)
        idx = np.argpartition(-lp, k - 1)[:k]
        idx = idx[np.lexsort((idx, -lp[idx]))]
        best = [(int(i), float(lp[i])) for i in idx]
    return float(lp[token]), best
