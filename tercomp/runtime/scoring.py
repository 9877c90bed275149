"""Scoring a sequence with a compiled LM: per-token log-probabilities and perplexity as
llama.cpp's `llama-perplexity` computes it (tools/perplexity/perplexity.cpp).

`perplexity` follows llama-perplexity's default mode exactly: the tokens (the text
tokenized with its BOS when the model adds one) are cut into `len(tokens) // n_ctx`
chunks of n_ctx; the first token of every chunk is replaced by the BOS (when the model
adds one); each chunk runs from an empty cache; only the second half is scored: the
logits at positions n_ctx/2 .. n_ctx - 2 predict the tokens after them (n_ctx - 1 -
n_ctx/2 tokens a chunk). The log-softmax is float64 (llama.cpp sums float32 exps in a
double). PPL = exp(mean negative log-likelihood), and its +/- is llama.cpp's
(the standard error of the mean, times the PPL).

    >>> lp = gen.score(ids)                       # [T - 1] log p(ids[t] | ids[:t])
    >>> perplexity(gen, tokens, n_ctx=512, bos=128000)["ppl"]
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from ..errors import InputError


def token_log_probs(logits, targets) -> np.ndarray:
    """log_softmax(logits[i])[targets[i]] in float64, for logits [N, vocab] and targets [N]."""
    x = np.asarray(logits, np.float64)
    m = x.max(axis=-1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(x - m).sum(axis=-1))
    return x[np.arange(x.shape[0]), np.asarray(targets)] - lse


def perplexity(gen, tokens, n_ctx: int, bos: int | None = None) -> dict:
    """llama-perplexity's figure for `tokens` (see the module docstring) with the
    LMGenerator `gen`: {"ppl", "ppl_error", "nll", "count", "chunks", "n_ctx"}.
    `n_ctx` from 2 to gen.max_seq; at least 2 * n_ctx tokens are needed."""
    try:
        tokens = np.asarray(tokens, np.int64).reshape(-1)
    except (ValueError, TypeError, OverflowError) as e:
        raise InputError(f"perplexity: tokens must be a sequence of token ids ({e})") from None
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, numbers.Integral) \
            or not 2 <= n_ctx <= gen.max_seq:
        raise InputError(f"perplexity: n_ctx must be an int from 2 to the cache length "
                         f"{gen.max_seq}, got {n_ctx!r}")
    if tokens.size < 2 * n_ctx:
        raise InputError(f"perplexity: the text is {tokens.size} tokens; a context of {n_ctx} "
                         f"needs at least {2 * n_ctx} (llama-perplexity's rule)",
                         hint="give a longer text or a smaller context")
    n_ctx = int(n_ctx)
    first = n_ctx // 2
    nll = nll2 = 0.0
    count = 0
    chunks = tokens.size // n_ctx
    for i in range(chunks):
        chunk = tokens[i * n_ctx:(i + 1) * n_ctx].astype(np.int32)
        if bos is not None:
            chunk[0] = bos
        logits = gen.prefill(chunk, logits_to_keep=n_ctx - first)    # positions first..
        lp = token_log_probs(logits[:-1], chunk[first + 1:])
        nll -= float(lp.sum())
        nll2 += float((lp * lp).sum())
        count += lp.size
    mean = nll / count
    var = nll2 / count - mean * mean
    err = math.sqrt(var / (count - 1)) if var > 0 and count > 1 else 0.0
    ppl = math.exp(mean)
    return {"ppl": ppl, "ppl_error": err * ppl, "nll": mean, "count": count,
            "chunks": chunks, "n_ctx": n_ctx}
