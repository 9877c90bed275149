"""Next-token sampling from logits: greedy, temperature, top-k, top-p (nucleus), min-p,
and the per-sequence transforms before them (logit bias; repetition, frequency and
presence penalties: `Penalties`).

Pure NumPy on the host (the logits of one step are a [vocab] vector); the same
`np.random.Generator` state gives the same tokens. The order is vLLM's: logit bias,
then the penalties, then temperature, min-p, top-k and top-p (greedy takes the argmax
after the penalties).

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
#: what a generated token's log-probabilities are of (vLLM's --logprobs-mode names): the
#: model's logits, or the distribution it was sampled from (`processed_logprobs`)
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


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


def probabilities(logits: np.ndarray, temperature: float, top_k=None, top_p=None,
                  min_p: float = 0.0) -> np.ndarray:
    """The distribution that `sample` draws from (float64, sums to 1). The logits are
    shifted by their maximum before the division by `temperature`, so a temperature
    as small as 1e-308 gives the limit distribution (the largest logits share the
    mass) instead of inf - inf = NaN. `min_p` keeps the tokens whose probability
    (after temperature) is at least min_p times the largest."""
    z = np.asarray(logits, np.float64)
    with np.errstate(over="ignore"):        # (z - max) / T <= 0: overflow is -inf, exp 0
        z = (z - z.max()) / float(temperature)
    keep = np.ones(z.shape, bool)
    if min_p:                               # p / p_max = exp(z - max z), max z = 0
        keep &= z >= np.log(min_p)
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


def sample(logits, temperature: float, top_k, top_p, rng: np.random.Generator,
           min_p: float = 0.0) -> int:
    """One token id from `logits` [vocab]. temperature 0: argmax (the first on ties)."""
    logits = np.asarray(logits)
    if temperature == 0:
        return int(np.argmax(logits))
    p = probabilities(logits, temperature, top_k, top_p, min_p)
    return int(rng.choice(p.size, p=p))


def processed_logprobs(logits, temperature: float, top_k=None, top_p=None,
                       min_p: float = 0.0) -> np.ndarray:
    """The log-probabilities of the distribution `sample` draws from (vLLM's
    processed_logprobs): of `logits` as given (the logit bias, penalties and grammar
    mask already applied) at temperature 0, else after temperature, min_p, top_k and
    top_p, the tokens they drop at -inf.

    >>> processed_logprobs(np.log(np.array([0.5, 0.3, 0.2])), 1.0, top_k=2).round(3)
    array([-0.47 , -0.981,   -inf])
    """
    if temperature == 0:
        return log_softmax(logits)
    with np.errstate(divide="ignore"):
        return np.log(probabilities(logits, temperature, top_k, top_p, min_p))


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


class Penalties:
    """The transforms of one sequence's logits before sampling, as vLLM applies them:
    `logit_bias` ({token id: value}) added, then `repetition` (> 0; 1 is off) dividing
    the positive logits and multiplying the negative ones of every token in the
    prompt or the output, then `frequency` times each token's count in the output and
    `presence` for each token present in it subtracted. `add(token)` counts an output
    token.

    >>> pen = Penalties(3, [0], presence=1.0)
    >>> pen.add(2)
    >>> pen.apply(np.array([1.0, 1.0, 1.0])).tolist()
    [1.0, 1.0, 0.0]
    """

    def __init__(self, vocab: int, prompt, presence: float = 0.0, frequency: float = 0.0,
                 repetition: float = 1.0, logit_bias=None):
        self.presence, self.frequency, self.repetition = presence, frequency, repetition
        bias = dict(logit_bias or {})
        self.bias_ids = np.array(list(bias), np.int64)
        self.bias = np.array(list(bias.values()), np.float32)
        self.counts = np.zeros(vocab, np.int32) if presence or frequency else None
        self.seen = None
        if repetition != 1.0:
            self.seen = np.zeros(vocab, bool)
            self.seen[np.asarray(prompt, np.int64)] = True
        self.active = bool(self.bias.size or self.counts is not None or self.seen is not None)

    def add(self, token: int) -> None:
        if self.counts is not None:
            self.counts[token] += 1
        if self.seen is not None:
            self.seen[token] = True

    def apply(self, logits) -> np.ndarray:
        z = np.array(logits, np.float32)
        if self.bias.size:
            np.add.at(z, self.bias_ids, self.bias)
        if self.seen is not None:
            z = np.where(self.seen, np.where(z > 0, z / self.repetition, z * self.repetition), z)
        if self.counts is not None:
            z -= self.frequency * self.counts + self.presence * (self.counts > 0)
        return z


def check_penalties(vocab: int, min_p, presence, frequency, repetition, logit_bias) -> None:
    """InputError unless 0 <= min_p <= 1, presence and frequency in [-2, 2] (OpenAI's
    range), repetition > 0 and logit_bias {token id in range: value in [-100, 100]}."""
    def number(x):
        return not isinstance(x, bool) and isinstance(x, numbers.Real) and np.isfinite(x)
    if not number(min_p) or not 0 <= min_p <= 1:
        raise InputError(f"min_p must be a number from 0 to 1, got {min_p!r}")
    for what, v in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not number(v) or not -2 <= v <= 2:
            raise InputError(f"{what} must be a number from -2 to 2, got {v!r}")
    if not number(repetition) or repetition <= 0:
        raise InputError(f"repetition_penalty must be a number > 0 (1 is off), got {repetition!r}")
    for t, v in (logit_bias or {}).items():
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab:
            raise InputError(f"logit_bias: token id {t!r} is not in [0, {vocab - 1}]")
        if not number(v) or not -100 <= v <= 100:
            raise InputError(f"logit_bias: the bias of token {t} must be a number from -100 "
                             f"to 100, got {v!r}")
