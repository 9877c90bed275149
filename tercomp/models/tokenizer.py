"""Tokenizers for loaded models, built with the `tokenizers` package.

- A Hugging Face directory with `tokenizer.json`: `tokenizers.Tokenizer.from_file`.
- A GGUF file: the vocabulary in its `tokenizer.ggml.*` keys becomes a `tokenizers`
  model: "gpt2" (byte-level BPE: tokens + merges) -> `models.BPE` with byte-level pre-
  tokenizer and decoder; "llama" (SentencePiece: tokens + scores) -> `models.Unigram`
  over the scores with SentencePiece's "▁" spaces and byte fallback (an approximation of
  SentencePiece-BPE encoding; decoding is exact). Other vocabulary types give None:
  token ids always work.

The GGUF keys are also kept (`lm.gguf_vocab`) so `save_gguf` writes the vocabulary back.
"""
from __future__ import annotations

import os
import warnings

try:
    import tokenizers
    from tokenizers import decoders, normalizers, pre_tokenizers
except ImportError:  # pragma: no cover - tokenizers is a dependency
    tokenizers = None

# GGUF tokenizer keys kept for writing back: key -> GGUFWriter method suffix
_VOCAB_KEYS = {
    "tokenizer.ggml.model": "string", "tokenizer.ggml.pre": "string",
    "tokenizer.ggml.tokens": "array", "tokenizer.ggml.scores": "array",
    "tokenizer.ggml.token_type": "array", "tokenizer.ggml.merges": "array",
    "tokenizer.ggml.bos_token_id": "uint32", "tokenizer.ggml.eos_token_id": "uint32",
    "tokenizer.ggml.unknown_token_id": "uint32", "tokenizer.ggml.padding_token_id": "uint32",
}


def tokenizer_from_json(path):
    """The `tokenizers.Tokenizer` of a tokenizer.json file, or None when there is none."""
    if not os.path.isfile(path) or tokenizers is None:
        return None
    try:
        return tokenizers.Tokenizer.from_file(os.fspath(path))
    except Exception as e:  # a broken tokenizer.json must not make the weights unusable
        warnings.warn(f"{path}: tokenizer not loaded ({e}); token ids still work")
        return None


def tokenizer_from_gguf(reader, path):
    """(tokenizers.Tokenizer or None, {key: (kind, value)}) from a GGUFReader's fields."""
    vocab = {}
    for key, kind in _VOCAB_KEYS.items():
        f = reader.fields.get(key)
        if f is None:
            continue
        try:
            v = f.contents()
        except Exception:
            continue
        vocab[key] = (kind, v)
    model = vocab.get("tokenizer.ggml.model", (None, None))[1]
    tokens = vocab.get("tokenizer.ggml.tokens", (None, None))[1]
    if tokenizers is None or not tokens or model not in ("gpt2", "llama"):
        return None, vocab
    try:
        if model == "gpt2":
            merges = vocab.get("tokenizer.ggml.merges", (None, []))[1]
            tok = tokenizers.Tokenizer(tokenizers.models.BPE(
                {t: i for i, t in enumerate(tokens)},
                [tuple(m.split(" ", 1)) for m in merges]))
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = decoders.ByteLevel()
        else:
            scores = vocab.get("tokenizer.ggml.scores", (None, [0.0] * len(tokens)))[1]
            unk = vocab.get("tokenizer.ggml.unknown_token_id", (None, 0))[1]
            tok = tokenizers.Tokenizer(tokenizers.models.Unigram(
                [(t, float(s)) for t, s in zip(tokens, scores)], unk_id=int(unk),
                byte_fallback=True))
            tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                                   normalizers.Replace(" ", "▁")])
            tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                             decoders.Fuse(), decoders.Strip(" ", 1, 0)])
        return tok, vocab
    except Exception as e:
        warnings.warn(f"{path}: could not build a {model!r} tokenizer ({e}); token ids still work")
        return None, vocab
