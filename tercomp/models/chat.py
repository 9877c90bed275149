"""Chat templates: a model's prompt format, rendered as transformers renders it.

A template is data that came with a model file (`tokenizer_config.json`'s
`chat_template`, a GGUF's `tokenizer.chat_template`), never code: it is rendered by
jinja2's immutable sandbox (no attribute access to Python internals, no mutation of the
arguments, bounded `range`), with the names transformers gives it: `messages`,
`add_generation_prompt`, `bos_token`, `eos_token`, the `tojson` filter, and
`raise_exception(msg)` / `strftime_now(fmt)`. Whatever goes wrong (a syntax error, a
`raise_exception`, a runaway loop) is a TercompError naming the template's origin.

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
        A ChatTemplateError when the template changes content other than trimming it
        (its text could not be told from the template's).

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
        parts = [(p if k % 2 == 0 else cores[p], k % 2 == 1) for k, p in enumerate(pieces)]
        if "".join(p for p, _ in parts) != text:
            raise ChatTemplateError(f"{self.origin}: the template changes message content "
                                    f"(more than trimming it), so its text cannot be told "
                                    f"from the template's special tokens")
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
