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

`lm.tokenizer` is a `Tokenizer`: the `tokenizers.Tokenizer` (every method of it works on
it) with the model's chat template, from `tokenizer_config.json` (`chat_template`,
`bos_token`, `eos_token`) or the GGUF's `tokenizer.chat_template` and bos/eos ids:
`apply_chat_template(messages, add_generation_prompt=True, tokenize=False)` as
transformers has it (runtime/chat.py renders it in jinja2's sandbox).
"""
from __future__ import annotations

import json
import os
import warnings

import numpy as np

from ..runtime.chat import ChatTemplate, ChatTemplateError, TextEncoder
from .gguf_scan import GGUFError

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
    "tokenizer.chat_template": "string", "tokenizer.ggml.add_eos_token": "bool",
    # how llama.cpp tokenizes text: without them a file written back would get its
    # defaults (a BOS and a space prefix for a "llama" vocabulary)
    "tokenizer.ggml.add_bos_token": "bool", "tokenizer.ggml.add_space_prefix": "bool",
    "tokenizer.ggml.add_sep_token": "bool", "tokenizer.ggml.remove_extra_whitespaces": "bool",
    "tokenizer.ggml.eot_token_id": "uint32", "tokenizer.ggml.eom_token_id": "uint32",
    "tokenizer.ggml.seperator_token_id": "uint32", "tokenizer.ggml.cls_token_id": "uint32",
    "tokenizer.ggml.mask_token_id": "uint32",
}
# llama.cpp token types
_NORMAL, _UNKNOWN, _CONTROL, _UNUSED, _BYTE = 1, 2, 3, 5, 6
#: a Unigram score no segmentation of text prefers (the piece is matched only otherwise)
_NEVER = -1e9
#: the largest tokenizer_config.json read (it holds a template and token strings)
MAX_TOKENIZER_CONFIG = 4 << 20


class Tokenizer:
    """A `tokenizers.Tokenizer` (`inner`; its methods are this object's) with the model's
    chat template (a runtime.chat.ChatTemplate, or None)."""

    def __init__(self, inner, chat_template=None):
        self.inner, self.chat_template = inner, chat_template
        self._encoder = None

    def __getattr__(self, name):
        if name in ("inner", "chat_template", "_encoder"):   # not set yet (copy, unpickle)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def apply_chat_template(self, messages, add_generation_prompt: bool = False,
                            tokenize: bool = True, parse_special: bool = False, **kwargs):
        """The prompt for `messages` ([{"role": ..., "content": ...}, ...]): text with
        `tokenize=False`, else its token ids (a list of ints; the template writes the
        special tokens itself, so none are added). A message's `</s>` or `<|eot_id|>`
        is text, not the special token, unless `parse_special` (TextEncoder)."""
        if self.chat_template is None:
            raise ChatTemplateError("this model's files carry no chat template",
                                    hint="render the prompt yourself and pass its text")
        if not tokenize:
            return self.chat_template.render(messages, add_generation_prompt, **kwargs)
        if self._encoder is None:
            self._encoder = TextEncoder(self.inner)
        parts = self.chat_template.render_parts(messages, add_generation_prompt, **kwargs)
        return list(self._encoder.encode_parts(parts, parse_special))

    def __repr__(self):
        chat = "with" if self.chat_template is not None else "without"
        return f"Tokenizer({self.inner.get_vocab_size()} tokens, {chat} a chat template)"


def _special(value) -> str:
    """A tokenizer_config.json special token: a string or {"content": str, ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def tokenizer_from_hf(directory):
    """The Tokenizer of a Hugging Face directory (tokenizer.json, with the chat template
    and special tokens of tokenizer_config.json), or None without tokenizer.json."""
    inner = tokenizer_from_json(os.path.join(directory, "tokenizer.json"))
    if inner is None:
        return None
    path = os.path.join(directory, "tokenizer_config.json")
    template = None
    if os.path.isfile(path):
        try:
            if os.path.getsize(path) > MAX_TOKENIZER_CONFIG:
                raise ValueError(f"{os.path.getsize(path)} bytes, over {MAX_TOKENIZER_CONFIG}")
            with open(path, encoding="utf-8") as f:
                cfg = json.load(f)
            if not isinstance(cfg, dict):
                raise ValueError("not a JSON object")
            source = cfg.get("chat_template")
            if isinstance(source, list):        # named templates: the "default" one
                named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
                source = named.get("default") or next(iter(named.values()), None)
            if source is not None:
                template = ChatTemplate(source, _special(cfg.get("bos_token")),
                                        _special(cfg.get("eos_token")),
                                        origin=f"{path} (chat_template)")
        except (OSError, ValueError, RecursionError, ChatTemplateError) as e:
            warnings.warn(f"{path}: chat template not loaded ({e}); text and ids still work")
    return Tokenizer(inner, template)


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
        want = {"string": str, "uint32": (int, np.integer), "array": list, "bool": bool}[kind]
        if not isinstance(v, want) or (isinstance(v, bool) and kind != "bool"):
            raise GGUFError(f"{path}: key {key!r}: expected a {kind}, got "
                            f"{type(v).__name__} {v!r:.60}")
        vocab[key] = (kind, v)
    model = vocab.get("tokenizer.ggml.model", (None, None))[1]
    tokens = vocab.get("tokenizer.ggml.tokens", (None, None))[1]
    if tokenizers is None or not tokens or model not in ("gpt2", "llama"):
        return None, vocab
    template = _gguf_chat_template(vocab, tokens, path)
    types = _token_types(vocab, tokens)
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
            # control and byte pieces are never matched from text (as in llama.cpp): the
            # bytes come from byte fallback, the control tokens as special added tokens
            scores = [_NEVER if types[i] in (_UNKNOWN, _CONTROL, _BYTE) else float(sc)
                      for i, sc in enumerate(scores)]
            tok = tokenizers.Tokenizer(tokenizers.models.Unigram(
                list(zip(tokens, scores)), unk_id=int(unk), byte_fallback=True))
            tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                                   normalizers.Replace(" ", "▁")])
            tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                             decoders.Fuse(), decoders.Strip(" ", 1, 0)])
        # control tokens are special: a chat template's <s> or <|eot_id|> is one token,
        # the same text in a user's message is text (tokenizers' encode_special_tokens)
        tok.add_special_tokens([tokenizers.AddedToken(tokens[i], special=True, normalized=False)
                                for i, t in enumerate(types) if t == _CONTROL and tokens[i]])
        return Tokenizer(tok, template), vocab
    except Exception as e:
        warnings.warn(f"{path}: could not build a {model!r} tokenizer ({e}); token ids still work")
        return None, vocab


def _token_types(vocab, tokens) -> list:
    """The llama.cpp type of every token: the file's `tokenizer.ggml.token_type`, or
    without it, `<0xNN>` pieces bytes and the bos / eos / unknown ids control."""
    types = vocab.get("tokenizer.ggml.token_type", (None, None))[1]
    if isinstance(types, list) and len(types) == len(tokens):
        return [int(t) if isinstance(t, (int, np.integer)) else _NORMAL for t in types]
    types = [_BYTE if len(t) == 6 and t.startswith("<0x") and t.endswith(">") else _NORMAL
             for t in tokens]
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id"):
        i = vocab.get(f"tokenizer.ggml.{key}", (None, None))[1]
        if isinstance(i, (int, np.integer)) and 0 <= int(i) < len(tokens):
            types[int(i)] = _CONTROL
    return types


def _gguf_chat_template(vocab, tokens, path):
    """The GGUF's `tokenizer.chat_template` with its bos/eos token strings, or None."""
    source = vocab.get("tokenizer.chat_template", (None, None))[1]
    if source is None:
        return None

    def token(key):
        i = vocab.get(key, (None, None))[1]
        return tokens[int(i)] if isinstance(i, (int, np.integer)) and 0 <= int(i) < len(tokens) \
            else ""
    try:
        return ChatTemplate(source, token("tokenizer.ggml.bos_token_id"),
                            token("tokenizer.ggml.eos_token_id"),
                            origin=f"{path} (tokenizer.chat_template)")
    except ChatTemplateError as e:
        warnings.warn(f"{e}; text and ids still work")
        return None




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


#: `tokenizer.ggml.pre` values for which llama.cpp adds a BOS to a BPE ("gpt2") text
#: (src/llama-vocab.cpp, the LLAMA3 pre-tokenizer group and two others)
_BPE_PRE_WITH_BOS = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "jina-v5-nano", "tekken", "chameleon")


def gguf_bos(keys: dict, path="") -> int | None:
    """The BOS id llama.cpp puts before a GGUF model's text, or None when it adds none:
    `tokenizer.ggml.add_bos_token` when the file has it, else yes for a SentencePiece
    ("llama") vocabulary and for the BPE ("gpt2") ones of Llama 3's pre-tokenizer group
    (llama-vocab.cpp's defaults). `keys` are the file's scalar keys (gguf_scan.scan)."""
    add = keys.get("tokenizer.ggml.add_bos_token")
    if add is None:
        model, pre = keys.get("tokenizer.ggml.model"), keys.get("tokenizer.ggml.pre")
        add = model == "llama" or (model == "gpt2" and pre in _BPE_PRE_WITH_BOS)
    if not add:
        return None
    bos = keys.get("tokenizer.ggml.bos_token_id")
    if isinstance(bos, bool) or not isinstance(bos, int):
        raise GGUFError(f"{path}: adds a BOS token but has no 'tokenizer.ggml.bos_token_id'")
    return bos
