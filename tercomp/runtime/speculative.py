"""Prompt-lookup (n-gram) drafting for speculative decoding: guess the next tokens of a
sequence from its own context, with no draft model (as Hugging Face's
`prompt_lookup_num_tokens` and vLLM's `ngram` speculator).

Text that repeats its context (code being edited, a document quoted back, a summary
that copies names) continues the way an earlier occurrence of its last few tokens did.
`prompt_lookup` proposes those tokens; the generator verifies them in ONE step that
scores every drafted position (runtime.generator.LMGenerator.generate with
`speculative="prompt_lookup"`), keeps the longest prefix that greedy decoding would
have produced plus the model's own next token, and rolls its position back over the
rejected rows. Tokens are then exactly greedy decoding's; a step that accepts `a`
drafts yields `a + 1` tokens for one call.

A verify call of k + 1 tokens costs more than a decode call (on a CPU the one-row
kernels are the cheapest per token: bench/RESULTS.md), so rejected drafts slow decoding
down. `DraftSchedule` sizes each draft from the last ones (Hugging Face's "heuristic"
schedule: 2 more after a draft accepted whole, 1 fewer after a rejection) and stops
drafting for a while, longer each time, when even one-token drafts are rejected.

    >>> prompt_lookup(np.array([5, 6, 7, 8, 5, 6]), num_draft=3).tolist()
    [7, 8, 5]
"""
from __future__ import annotations

import numpy as np

#: the methods `generate(speculative=...)` knows
METHODS = ("prompt_lookup",)


def prompt_lookup(context: np.ndarray, num_draft: int, max_ngram: int = 3) -> np.ndarray:
    """At most `num_draft` tokens that followed an earlier occurrence of the last n tokens
    of `context` (n from `max_ngram` down to 1, the longest that occurs first), or an
    empty array. Of several occurrences the most recent one with `num_draft` tokens after
    it is taken (the latest edit of a document), else the one with the most tokens after it."""
    context = np.asarray(context)
    size = context.size
    for n in range(min(max_ngram, size - 1), 0, -1):
        # windows of context[:-1]: every occurrence has at least one token after it,
        # and the last n tokens themselves are not one
        windows = np.lib.stride_tricks.sliding_window_view(context[:-1], n)
        hits = np.flatnonzero((windows == context[size - n:]).all(axis=1))
        if hits.size:
            full = hits[hits + n + num_draft <= size]
            start = (full[-1] if full.size else hits[0]) + n
            return context[start:start + num_draft].astype(np.int32)
    return np.zeros(0, np.int32)


def accepted(draft: np.ndarray, logits: np.ndarray) -> int:
    """How many tokens of `draft` [d] greedy decoding confirms, given the verify step's
    `logits` [d + 1, vocab] (row i predicts the token after draft[:i]): the length of
    the longest prefix of `draft` equal to the rows' argmax."""
    best = np.argmax(logits[:draft.size], axis=-1)
    wrong = np.flatnonzero(best != draft)
    return int(wrong[0]) if wrong.size else int(draft.size)


class DraftSchedule:
    """How many tokens to draft at each step, at most `most`: `size()` before a step (0:
    run one token plainly), `update(drafted, accepted)` after it."""

    def __init__(self, most: int):
        self.most, self.length, self.pause, self.backoff = int(most), int(most), 0, 1

    def size(self) -> int:
        if self.pause:
            self.pause -= 1
            return 0
        return self.length

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        if accepted == drafted:
            self.length, self.backoff = min(self.most, self.length + 2), 1
        elif accepted == 0 and self.length == 1:     # not even one: plain steps for a while
            self.pause, self.backoff = self.backoff, min(2 * self.backoff, 32)
        else:
            self.length = max(1, self.length - 1)


__all__ = ["prompt_lookup", "accepted", "DraftSchedule", "METHODS"]
