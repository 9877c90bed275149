"""Structured output: `response_format` (and vLLM's and llama-server's grammar fields)
enforced token by token with llguidance (the constrained-decoding library of
Microsoft's Guidance, used by vLLM and llama.cpp).

A request's JSON schema (`json_schema`; `json_object` is the schema of any object),
regular expression, choice or GBNF / Lark grammar is compiled once into an llguidance
grammar; each generated sequence gets its own
`Constraint` (a matcher over the model's tokenizer) that the engine asks, before it
samples, which tokens may come next (the others' logits become -inf), and tells which
token was sampled. When the grammar is complete the sequence stops. JSON is compact
(no free whitespace: a model cannot fill its tokens with blanks).

    >>> grammar = Grammars(tokenizer, vocab_size, eos).compile("json", schema)
    >>> engine.submit(ids, constraint=grammar.constraint())
"""
from __future__ import annotations

import json
import threading

import numpy as np

try:
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark
except ImportError:     # pragma: no cover - the serve extra installs it
    llguidance = None

#: llguidance's JSON options: compact separators, no whitespace between tokens
JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A response_format that cannot be enforced (the message says why)."""


class Grammars:
    """Compiles response formats for one model: its `tokenizer` (tokenizers.Tokenizer),
    `vocab_size` (the model's logits) and `eos` token id. The llguidance tokenizer is
    built on first use (a large vocabulary takes a second)."""

    def __init__(self, tokenizer, vocab_size: int, eos):
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, eos
        self._lltok = None
        self._lock = threading.Lock()

    def compile(self, kind: str, value) -> "Grammar":
        """The grammar of `kind` "json" (`value` a JSON schema, a dict or its text; None:
        any object), "regex" (a regular expression), "choice" (a list of strings) or
        "grammar" (GBNF, as llama-server takes it, or Lark) or "lark" (llguidance's Lark, as
        serve.tools writes it), or a GrammarError."""
        if llguidance is None:
            raise GrammarError("structured output needs llguidance, which is not installed "
                               "(pip install 'tercomp[serve]')")
        if self.tokenizer is None or self.eos is None:
            raise GrammarError("structured output needs the model's tokenizer and eos token")
        try:
            if kind == "json":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    {"type": "object"} if value is None else value, defaults=JSON_OPTIONS)
            elif kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(value)
            elif kind == "choice":
                grammar = "start: " + " | ".join(json.dumps(c) for c in value)
            elif kind == "lark":
                grammar = value
            else:
                grammar = any_to_lark(value)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"not a valid {kind}: {e}") from None
        except Exception as e:      # the GBNF converter's own errors
            raise GrammarError(f"not a valid grammar: {e}") from None
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"it cannot be enforced: {matcher.get_error()}")
        return Grammar(matcher, self.vocab_size)

    def _tokenizer(self):
        with self._lock:
            if self._lltok is None:
                self._lltok = llguidance.LLTokenizer(self.tokenizer.to_str(),
                                                     n_vocab=self.vocab_size,
                                                     eos_token=int(self.eos))
            return self._lltok


class Grammar:
    """A compiled grammar; `constraint()` is a fresh matcher for one sequence."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size

    def constraint(self) -> "Constraint":
        return Constraint(self.matcher.deep_copy(), self.vocab_size)


class Constraint:
    """One sequence's matcher, as runtime.Engine uses it: `mask(logits)` (the logits
    with the tokens the grammar forbids at -inf; None when it allows none: an error),
    `accept(token)` (False: the token broke the grammar), `done` (the grammar is
    complete: the sequence ends)."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size

    def mask(self, logits) -> np.ndarray | None:
        if self.matcher.is_error():
            return None
        bits = np.frombuffer(self.matcher.compute_bitmask(), np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:self.vocab_size].astype(bool)
        if not allowed.any():
            return None
        return np.where(allowed, np.asarray(logits, np.float32), np.float32(-np.inf))

    def accept(self, token: int) -> bool:
        return bool(self.matcher.consume_token(int(token)))

    @property
    def done(self) -> bool:
        return bool(self.matcher.is_stopped())

    @property
    def error(self) -> str:
        return self.matcher.get_error() or "the grammar allows no token"
