"""tc.compile_embed: a language model compiled as a text encoder (sentence embeddings).

The encoder is the model's own forward without its output layer (`lm.hidden_states`,
no KV cache: every token of a sequence in one pass), then pooling over each sequence's
real tokens and L2 normalisation, as sentence-transformers and llama.cpp's
`llama-embedding` compute them:

    "last"  the hidden state of the last token (BitNet's embedding models: an EOS there)
    "mean"  the mean over the sequence's tokens
    "cls"   the first token's

A batch holds sequences of different lengths, padded on the right to one length and
told apart by their lengths: attention is causal, so a real token never reads a pad
and padding changes no real token's hidden state. One module is compiled per padded
length (powers of two from 16, and max_seq), on first use, for any batch size (B is
symbolic); the compile cache keys each on its traced program, as tc.compile does.

    >>> enc = tc.compile_embed(models.load("bitnet-embedding-0.6b.gguf"), max_seq=512)
    >>> e = enc.embed(["query: What is BitNet?", "BitNet is a 1-bit LLM."])   # [2, 1024]
    >>> float(e[0] @ e[1])                                                    # their cosine
"""
from __future__ import annotations

import numpy as np

from . import nn
from .compiler import compile as _compile
from .errors import ConfigError, InputError, UnsupportedError
from .models.bitnet import BitNetLM
from .models.config import POOLINGS
from .tracing import api as _t
from .tracing import spec

__all__ = ["compile_embed", "Embedder"]

#: the shortest padded length a module is compiled for
MIN_BUCKET = 16


class _Encoder(nn.Module):
    """(ids [B, T] int32, lengths [B] int32) -> pooled (and normalised) [B, hidden]: the
    model's own forward, then the pooling over positions 0..lengths[b]-1."""

    def __init__(self, lm: BitNetLM, pooling: str, normalize: bool):
        self.lm = lm
        self.pooling, self.normalize = pooling, normalize

    def forward(self, ids, lengths):
        t = ids.shape[1]
        h = self.lm.hidden_states(ids)                                  # [B, T, hidden]
        pos = np.arange(t, dtype=np.int32)[None, :]                     # [1, T]
        n = lengths.reshape(-1, 1)                                      # [B, 1]
        if self.pooling == "last":
            w = _t.equal(pos, n - np.int32(1)).astype("float32")
        elif self.pooling == "mean":
            w = _t.less(pos, n).astype("float32") / n.astype("float32")
        e = h[:, 0, :] if self.pooling == "cls" else _t.sum(h * w.reshape(-1, t, 1), axis=1)
        if self.normalize:      # sentence-transformers' Normalize: x / max(|x|, 1e-12)
            norm = _t.sqrt(_t.sum(e * e, axis=-1, keepdims=True))
            e = e / _t.maximum(norm, np.float32(1e-12))
        return e


class Embedder:
    """Sequence embeddings of a compiled model (see the module docstring).

    `embed(inputs)`: `inputs` is a list of token-id lists, or a list of strings (with
    the model's tokenizer), or one string; returns float32 [len(inputs), hidden].
    `__call__(ids [B, T], lengths [B])` runs one padded batch as it is."""

    def __init__(self, lm, max_seq, pooling, normalize, batch, eos, options):
        self.lm, self.max_seq, self.pooling, self.normalize = lm, max_seq, pooling, normalize
        self.max_batch, self.eos, self._options = batch, eos, options
        self.tokenizer = lm.tokenizer
        self.hidden_size = lm.config.hidden_size
        self._modules = {}

    def bucket(self, n: int) -> int:
        """The padded length a sequence of n tokens is run at."""
        b = MIN_BUCKET
        while b < n:
            b *= 2
        return min(b, self.max_seq)

    def module(self, t: int):
        """The compiled encoder for padded length t (compiled on first use)."""
        if t not in self._modules:
            enc = _Encoder(self.lm, self.pooling, self.normalize)
            self._modules[t] = _compile(enc, spec(("B", t), "int32"), spec(("B",), "int32"),
                                        **self._options)
        return self._modules[t]

    def __call__(self, ids, lengths) -> np.ndarray:
        ids = np.ascontiguousarray(ids, np.int32)
        lengths = np.ascontiguousarray(lengths, np.int32)
        if ids.ndim != 2 or lengths.shape != ids.shape[:1] or not 1 <= ids.shape[1] <= self.max_seq:
            raise InputError(f"an Embedder call takes ids [B, T] (T <= max_seq {self.max_seq}) "
                             f"and lengths [B], got {ids.shape} and {lengths.shape}")
        if lengths.size and not ((lengths >= 1) & (lengths <= ids.shape[1])).all():
            raise InputError(f"lengths must be from 1 to T = {ids.shape[1]}, got "
                             f"{lengths.tolist()[:8]}")
        return np.asarray(self.module(ids.shape[1])(ids, lengths))

    def encode(self, text: str) -> list:
        """The token ids of `text`: the tokenizer's (with its special tokens), and the
        model's EOS after them where its file asks for one (last-token pooling reads it)."""
        if self.tokenizer is None:
            raise UnsupportedError("this model has no tokenizer", hint="pass token ids instead of text")
        ids = list(self.tokenizer.encode(text).ids)
        if self.eos is not None and (not ids or ids[-1] != self.eos):
            ids.append(self.eos)
        return ids

    def embed(self, inputs) -> np.ndarray:
        """float32 [len(inputs), hidden]: one row per string or token-id list."""
        seqs = self.sequences(inputs)
        out = np.empty((len(seqs), self.hidden_size), np.float32)
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))   # like lengths together
        for lo in range(0, len(order), self.max_batch):
            idx = order[lo:lo + self.max_batch]
            t = self.bucket(max(len(seqs[i]) for i in idx))
            ids = np.zeros((len(idx), t), np.int32)
            for r, i in enumerate(idx):
                ids[r, :len(seqs[i])] = seqs[i]
            out[idx] = self(ids, [len(seqs[i]) for i in idx])
        return out

    def sequences(self, inputs) -> list:
        """`inputs` (as `embed` takes them) as checked token-id lists: a TercompError
        names the first input that is empty, too long or outside the vocabulary."""
        if isinstance(inputs, str):
            inputs = [inputs]
        if not isinstance(inputs, (list, tuple)) or not inputs:
            raise InputError(f"embed expects a non-empty list of strings or of token-id "
                             f"lists, got {type(inputs).__name__}")
        vocab = self.lm.config.vocab_size
        seqs = []
        for k, x in enumerate(inputs):
            if isinstance(x, str):
                x = self.encode(x)
            elif isinstance(x, np.ndarray) and x.ndim == 1 and x.dtype.kind in "iu":
                x = x.tolist()
            if not isinstance(x, (list, tuple)) or not all(
                    isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in x):
                raise InputError(f"embed: input {k} is neither a string nor a list of token ids")
            if not x:
                raise InputError(f"embed: input {k} has no tokens")
            if len(x) > self.max_seq:
                raise InputError(f"embed: input {k} has {len(x)} tokens, more than max_seq "
                                 f"{self.max_seq}", hint="compile_embed with a larger max_seq")
            bad = [i for i in x if not 0 <= i < vocab]
            if bad:
                raise InputError(f"embed: input {k} holds token id {bad[0]}, outside the "
                                 f"vocabulary of {vocab}")
            seqs.append([int(i) for i in x])
        return seqs


def compile_embed(lm, max_seq: int | None = None, pooling: str | None = None,
                  normalize: bool = True, max_batch: int = 32, **options) -> Embedder:
    """An Embedder of `lm` (a models.BitNetLM): sequences of up to `max_seq` tokens
    (default the model's max_position_embeddings, at most 2048) pooled by `pooling`
    ("last", "mean" or "cls"; default what the model file says, else "last"), L2
    normalised unless `normalize=False`, `max_batch` sequences a call. `options` go to
    tc.compile (target, device, threads, ternary, cache, ...).

    >>> enc = tc.compile_embed(lm, max_seq=512)
    >>> enc.embed([[1, 2, 3], [4, 5]]).shape
    (2, 1024)
    """
    if not isinstance(lm, BitNetLM):
        raise ConfigError(f"compile_embed expects a models.BitNetLM, got {type(lm).__name__}",
                          hint="load one with models.load(path)")
    c = lm.config
    if max_seq is None:
        max_seq = min(2048, c.max_position_embeddings)
    if isinstance(max_seq, bool) or not isinstance(max_seq, (int, np.integer)) or \
            not 1 <= max_seq <= c.max_position_embeddings:
        raise ConfigError(f"compile_embed: max_seq must be an integer from 1 to the model's "
                          f"max_position_embeddings {c.max_position_embeddings}, got {max_seq!r}")
    pooling = pooling if pooling is not None else (c.pooling or "last")
    if pooling not in POOLINGS:
        raise ConfigError(f"compile_embed: pooling must be one of {', '.join(POOLINGS)}, "
                          f"got {pooling!r}")
    if not isinstance(normalize, bool):
        raise ConfigError(f"compile_embed: normalize must be true or false, got {normalize!r}")
    if isinstance(max_batch, bool) or not isinstance(max_batch, (int, np.integer)) or \
            not 1 <= max_batch <= 4096:
        raise ConfigError(f"compile_embed: max_batch must be an integer from 1 to 4096, "
                          f"got {max_batch!r}")
    return Embedder(lm, int(max_seq), pooling, normalize, int(max_batch), _eos(lm), options)


def _eos(lm):
    """The EOS id a GGUF asks to append (`tokenizer.ggml.add_eos_token`: bitnet.cpp's
    converter sets it for Qwen3, whose last-token pooling reads that EOS), else None."""
    vocab = getattr(lm, "gguf_vocab", None) or {}
    if vocab.get("tokenizer.ggml.add_eos_token", (None, False))[1] is True:
        eos = vocab.get("tokenizer.ggml.eos_token_id", (None, None))[1]
        return None if eos is None else int(eos)
    return None
