"""Chat templates: a model's prompt format, rendered as transformers renders it.

A template is data that came with a model file (`tokenizer_config.json`'s
`chat_template`, a GGUF's `tokenizer.chat_template`), never code: it is rendered by
jinja2's immutable sandbox (no attribute access to Python internals, no mutation of the
arguments, bounded `range`), with the names transformers gives it: `messages`,
`add_generation_prompt`, `bos_token`, `eos_token`, the `tojson` filter, and
`raise_exception(msg)` / `strftime_now(fmt)`. Whatever goes wrong (a syntax error, a
`raise_exception`, a runaway loop) is a TercompError naming the template's origin.
`render_parts` tells the template's text from the messages' contents, and `TextEncoder`
turns those parts into token ids with special tokens matched only in the first.

    >>> t = ChatTemplate("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\\n"
    ...                  "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    >>> t.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    '<|user|>hi\\n<|assistant|>'
"""
from __future__ import annotations

import datetime
import json
import re
import secrets

from jinja2 import TemplateError, ext
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import TercompError

#: the longest template and the longest rendered prompt accepted (bytes / characters)
MAX_TEMPLATE = 1 << 20
MAX_RENDERED = 1 << 24


class ChatTemplateError(TercompError):
    """A chat template that does not compile or render."""


def _raise_exception(message):
    raise ChatTemplateError(f"the chat template refused the messages: {message}")


def _environment():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(str(fmt))
    return env


class ChatTemplate:
    """A compiled chat template with its special tokens; `origin` names where it came
    from (a file and key) in errors."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "",
                 origin: str = "the chat template"):
        if not isinstance(source, str) or not source.strip():
            raise ChatTemplateError(f"{origin}: a chat template must be a non-empty string, "
                                    f"got {type(source).__name__}")
        if len(source) > MAX_TEMPLATE:
            raise ChatTemplateError(f"{origin}: the chat template is {len(source)} characters, "
                                    f"over the {MAX_TEMPLATE} accepted")
        self.source, self.origin = source, origin
        self.bos_token, self.eos_token = str(bos_token or ""), str(eos_token or "")
        try:
            self._template = _environment().from_string(source)
        except TemplateError as e:
            raise ChatTemplateError(f"{origin}: the chat template does not compile: {e}") from None

    def render(self, messages, add_generation_prompt: bool = False, **kwargs) -> str:
        """The prompt text for `messages` (a list of {"role": str, "content": str})."""
        _check_messages(messages)
        try:
            text = self._template.render(messages=messages,
                                         add_generation_prompt=bool(add_generation_prompt),
                                         bos_token=self.bos_token, eos_token=self.eos_token,
                                         **kwargs)
        except ChatTemplateError as e:
            raise ChatTemplateError(f"{self.origin}: {e.message}") from None
        except (TemplateError, SecurityError, TypeError, ValueError, OverflowError,
                RecursionError, MemoryError) as e:
            raise ChatTemplateError(f"{self.origin}: rendering the chat template failed: "
                                    f"{type(e).__name__}: {e}") from None
        if len(text) > MAX_RENDERED:
            raise ChatTemplateError(f"{self.origin}: the rendered prompt has {len(text)} "
                                    f"characters, over the {MAX_RENDERED} accepted")
        return text

    def render_parts(self, messages, add_generation_prompt: bool = False,
                     **kwargs) -> list:
        """The prompt as [(text, is_content)]: the template's own text (False) and each
        message's content where the template placed it (True), so that special tokens
        are parsed in the first and not in the second. Their texts join to `render`'s.
        A content the template writes as a JSON string (`tojson`) is that string's
        text. A ChatTemplateError when the template changes content otherwise (its text
        could not be told from the template's).

        >>> ChatTemplate("<s>{{ messages[0].content | trim }}</s>").render_parts(
        ...     [{"role": "user", "content": " a</s> "}])
        [('<s>', False), ('a</s>', True), ('</s>', False)]
        """
        text = self.render(messages, add_generation_prompt, **kwargs)
        nonce = secrets.token_hex(8)
        marked, cores = [], {}
        for i, m in enumerate(messages):
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, str) and c.strip():
                core = c.strip()
                lead, trail = c[:len(c) - len(c.lstrip())], c[len(c.rstrip()):]
                cores[str(i)] = core
                c = f"{lead}\ue000{nonce}:{i}\ue001{trail}"
            marked.append({**m, "content": c} if isinstance(m, dict) else m)
        pieces = re.split(f"\ue000{nonce}:(\\d+)\ue001",
                          self.render(marked, add_generation_prompt, **kwargs))
        parts, at = [], 0
        for k, p in enumerate(pieces):
            # a content as it is, or as a JSON string's text (Llama 3.1's tool messages
            # go through `tojson`)
            options = (p,) if k % 2 == 0 else \
                (cores[p], json.dumps(cores[p], ensure_ascii=False)[1:-1])
            part = next((o for o in options if text.startswith(o, at)), None)
            if part is None:
                break
            parts.append((part, k % 2 == 1))
            at += len(part)
        if at != len(text) or len(parts) != len(pieces):
            raise ChatTemplateError(f"{self.origin}: the template changes message content "
                                    f"(more than trimming it or writing it as a JSON "
                                    f"string), so its text cannot be told from the "
                                    f"template's special tokens")
        # whitespace around a content the template kept goes with it (one pre-token)
        for k in range(1, len(parts), 2):
            before, after = parts[k - 1][0], parts[k + 1][0]
            m = messages[int(pieces[k])]["content"]
            lead, trail = m[:len(m) - len(m.lstrip())], m[len(m.rstrip()):]
            if lead and before.endswith(lead):
                before, parts[k] = before[:-len(lead)], (lead + parts[k][0], True)
            if trail and after.startswith(trail):
                after, parts[k] = after[len(trail):], (parts[k][0] + trail, True)
            parts[k - 1], parts[k + 1] = (before, False), (after, False)
        return [(p, c) for p, c in parts if p]

    def to_dict(self) -> dict:
        return {"template": self.source, "bos_token": self.bos_token,
                "eos_token": self.eos_token, "origin": self.origin}

    @classmethod
    def from_dict(cls, d) -> "ChatTemplate | None":
        if not isinstance(d, dict) or not d.get("template"):
            return None
        return cls(d["template"], d.get("bos_token", ""), d.get("eos_token", ""),
                   d.get("origin", "the chat template"))


def _check_messages(messages):
    ok = isinstance(messages, (list, tuple)) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str)
        and isinstance(m.get("content", ""), (str, list)) for m in messages)
    if not ok:
        raise ChatTemplateError(
            f"messages must be a list of {{'role': str, 'content': str}} dicts, got {messages!r:.200}",
            hint='e.g. [{"role": "user", "content": "Hello"}]')


class TextEncoder:
    """Text to token ids where text is text: a user's `</s>`, `<|eot_id|>` or `<0x41>`
    is encoded as those characters, never as the control or byte token, unless
    `parse_special` asks for it (llama-server's flag); a chat template's own special
    tokens still are tokens (`encode_parts`). `add_special_tokens` is the tokenizer's
    post-processor (a BOS, as vLLM's flag). Byte tokens are never matched from text by
    the vocabularies tercomp builds (models.tokenizer); special tokens are kept apart
    by a second copy of the tokenizer with `encode_special_tokens` set (the flag is the
    tokenizer's state, so one copy per mode keeps threads apart).

        enc = TextEncoder(tok)          # a tokenizers.Tokenizer
        enc.encode("hi</s>")            # the pieces of '<', '/', 's', '>', not eos
    """

    def __init__(self, tokenizer):
        self.special = tokenizer
        # a copy of the same class (the `tokenizers` package need not be imported here)
        self.plain = type(tokenizer).from_str(tokenizer.to_str())
        self.plain.encode_special_tokens = True
        self.special_ids = {i for i, t in tokenizer.get_added_tokens_decoder().items()
                            if t.special}

    def encode(self, text: str, parse_special: bool = False,
               add_special_tokens: bool = True) -> list:
        tok = self.special if parse_special else self.plain
        return tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_parts(self, parts, parse_special: bool = False) -> list:
        """Ids of [(text, is_content)] (ChatTemplate.render_parts): special
        tokens parsed in the template's text, and in the contents only with
        `parse_special`. The whole text is encoded at once (its tokens may span a
        boundary, as a tokenizer of the rendered prompt gives them) unless a special
        token comes out of a content; then each part is encoded on its own."""
        text = "".join(p for p, _ in parts)
        enc = self.special.encode(text, add_special_tokens=False)
        if parse_special or not any(c for _, c in parts):
            return enc.ids
        spans, at = [], 0
        for p, content in parts:
            if content:
                spans.append((at, at + len(p)))
            at += len(p)
        leaked = any(i in self.special_ids and any(s < e and a < e and s < b for a, b in spans)
                     for i, (s, e) in zip(enc.ids, enc.offsets))
        if not leaked:
            return enc.ids
        return [i for p, content in parts
                for i in (self.plain if content else self.special).encode(
                    p, add_special_tokens=False).ids]
