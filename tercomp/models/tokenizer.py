"""Tokenizers for loaded models, built with the `tokenizers` package.

- A Hugging Face directory with `tokenizer.json`: `tokenizers.Tokenizer.from_file`.
- A GGUF file: the vocabulary in its `tokenizer.ggml.*` keys becomes a `tokenizers`
  model: "gpt2" (byte-level BPE: tokens + merges) -> `models.BPE` with byte-level pre-
  tokenizer and decoder; "llama" (SentencePiece: tokens + scores) -> `models.Unigram`
  over the scores with SentencePiece's "▁" spaces and byte fallback (an approximation of
  SentencePiece-BPE encoding; decoding is exact). Other vocabulary types give None:
  token ids always work.

The GGUF keys are also kept (`lm.gguf_vocab`) so `save_gguf` writes the vocabulary back;
a `tokenizers` BPE or Unigram tokenizer (from tokenizer.json) is written as a "gpt2" or
"llama" vocabulary (`gguf_vocab_from_tokenizer`).
"""
from __future__ import annotations

import json
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


# llama.cpp token types
_NORMAL, _CONTROL, _UNUSED = 1, 3, 5


def gguf_vocab_from_tokenizer(tok, vocab_size: int):
    """The `tokenizer.ggml.*` keys ({key: (kind, value)}) for a `tokenizers` BPE
    ("gpt2") or Unigram ("llama") tokenizer, padded with unused tokens to `vocab_size`;
    None when the model type has no GGUF equivalent or holds more tokens than the model."""
    try:
        spec = json.loads(tok.to_str())
    except Exception:
        return None
    model = spec.get("model") or {}
    special = {t["id"]: t["content"] for t in spec.get("added_tokens") or []
               if t.get("special")}
    if model.get("type") == "BPE":
        pieces = {i: t for t, i in model.get("vocab", {}).items()}
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
        scores, kind = None, "gpt2"
    elif model.get("type") == "Unigram":
        pieces = {i: p for i, (p, _) in enumerate(model.get("vocab", []))}
        scores = [float(sc) for _, sc in model.get("vocab", [])]
        merges, kind = None, "llama"
    else:
        return None
    pieces.update({i: t for i, t in special.items()})
    if not pieces or max(pieces) >= vocab_size:
        return None
    tokens = [pieces.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [_CONTROL if i in special else _NORMAL if i in pieces else _UNUSED
             for i in range(vocab_size)]
    out = {"tokenizer.ggml.model": ("string", kind), "tokenizer.ggml.tokens": ("array", tokens),
           "tokenizer.ggml.token_type": ("array", types)}
    if merges:
        out["tokenizer.ggml.merges"] = ("array", merges)
    if scores is not None:
        out["tokenizer.ggml.scores"] = ("array", scores + [-1e9] * (vocab_size - len(scores)))
    return out
