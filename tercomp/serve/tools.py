"""Tool calling in chat: the offered tools rendered into the prompt, the model's calls
parsed back into OpenAI's `tool_calls`, and `tool_choice` "required" or a named function
enforced as a grammar (serve.structured), as vLLM's and llama-server's servers do.

The prompt: a chat template that renders `tools` (transformers' `apply_chat_template(
tools=...)`: Qwen 2.5/3, Hermes, Llama 3.1, ...) gets them, and the history's assistant
`tool_calls` (arguments as objects) and `tool` messages as it expects them. A template
that ignores `tools` gets the generic format of llama-server's generic handler, in
Hermes' words (`fallback_system`): a system message listing the functions' JSON schemas
and asking for

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and, when it also ignores `tool_calls`, the history written the same way: an assistant's
calls as those blocks in its content, a tool's answers as a user message of
`<tool_response>` blocks (`polyfill`). Whether a template handles them is found once by
rendering probes (`TemplateSupport`).

The answer, in the syntax the prompt asked for (`template_syntax`: the generic format
and Hermes/Qwen templates "hermes"; a template that writes tools itself in Llama 3.1's
or Mistral's words "llama3_json" or "mistral", as vLLM's tool parsers of those names
read them), is split into content and calls by `ToolParser`, the same code for whole
answers and streams:
- hermes: `<tool_call>` blocks holding a JSON object whose `name` is an offered tool
  are the calls, the text outside them the content;
- llama3_json: an answer that starts with a JSON object (or `<|python_tag|>`) is calls,
  `{"name": ..., "parameters": {...}}` objects separated by ";";
- mistral: the text before `[TOOL_CALLS]` is content, after it a JSON list of
  `{"name": ..., "arguments": {...}}` (v0.3) or `name[ARGS]{...}` calls (v11).
Anything else (text that is not JSON, an unknown name, a call cut short by max_tokens)
stays content. "required" and a named tool_choice force a call in the same syntax
(`call_grammar`).

    >>> p = ToolParser({"f"})
    >>> p.push('hi <tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>')
    [('content', 'hi'), ('call', ('f', {'x': 1}))]
"""
from __future__ import annotations

import hashlib
import json
import re
import secrets
import string
import uuid
from typing import NamedTuple

from ..runtime.chat import ChatTemplateError
from .structured import JSON_OPTIONS

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>\Z", re.S)


def fallback_system(tools: list) -> str:
    """The generic tool prompt (Hermes' and Qwen 2.5's words): every function's JSON
    schema, one a line, and the format of a call."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listing}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n"
            f'{OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}')


def call_text(name: str, arguments) -> str:
    """One call as the generic format writes it (and the grammar forces it)."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


#: The call syntaxes a prompt may ask for (vLLM's tool-parser names).
SYNTAXES = ("hermes", "llama3_json", "mistral")
PYTHON_TAG, MISTRAL_TAG, MISTRAL_ARGS = "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]"
#: each syntax's tags: text that a model's vocabulary may hold as one special token
#: (Mistral's [TOOL_CALLS], Llama 3.1's <|python_tag|>, some Qwen conversions'
#: <tool_call>), which the answer's text keeps and a forced call writes as that token
TAGS = {"hermes": (OPEN, CLOSE), "llama3_json": (PYTHON_TAG,),
        "mistral": (MISTRAL_TAG, MISTRAL_ARGS)}


def template_syntax(source: str) -> str:
    """The call syntax a chat template that writes tools asks the model for: "mistral"
    where it knows `[TOOL_CALLS]`, "llama3_json" where it knows Llama 3.1's
    `<|python_tag|>` or `ipython` role, else "hermes" (`<tool_call>` blocks: Hermes,
    Qwen 2.5 / 3 and the generic format).

    >>> template_syntax("... [TOOL_CALLS] ..."), template_syntax("{{ '<tool_call>' }}")
    ('mistral', 'hermes')
    """
    if MISTRAL_TAG in source:
        return "mistral"
    if PYTHON_TAG in source or "ipython" in source:
        return "llama3_json"
    return "hermes"


class TemplateSupport(NamedTuple):
    """What a chat template renders itself: `tools` (the offered functions) and `calls`
    (the history's assistant tool_calls; its tool messages with them), and the call
    `syntax` its tool prompt asks for ("hermes" where the generic format is used)."""
    tools: bool
    calls: bool
    syntax: str = "hermes"

    @classmethod
    def probe(cls, template) -> "TemplateSupport":
        """Render probes with names nobody writes: a template handles what it writes (the
        call names another function than the tool offered, so a template that lists
        the tools but drops the calls is not taken for one that writes them)."""
        name = f"tercomp_probe_{secrets.token_hex(4)}"
        called = f"{name}_called"
        tool = {"type": "function", "function": {
            "name": name, "description": "probe",
            "parameters": {"type": "object", "properties": {}}}}
        user = {"role": "user", "content": "hi"}
        # an id of 9 letters and digits: Mistral's templates raise on any other
        call = {"role": "assistant", "content": "", "tool_calls": [
            {"id": "tercomp00", "type": "function", "function": {"name": called, "arguments": {}}}]}
        answer = {"role": "tool", "content": "ok", "tool_call_id": "tercomp00"}

        def writes(needle, messages, **kw) -> bool:
            try:
                return needle in template.render(messages, add_generation_prompt=True, **kw)
            except ChatTemplateError:
                return False
        tools = writes(name, [user], tools=[tool])
        offered = [tool] if tools else None
        # a user turn after the tool's answer, or none (Mistral's templates count user
        # and assistant turns around the calls, and refuse two user turns in a row)
        calls = writes(called, [user, call, answer, user], tools=offered) or \
            writes(called, [user, call, answer], tools=offered)
        return cls(tools, calls, template_syntax(template.source) if tools else "hermes")


def polyfill(messages: list) -> list:
    """The history for a template that does not write tool calls: an assistant's calls
    appended to its content as <tool_call> blocks, a run of tool messages as one user
    message of <tool_response> blocks (Qwen 2.5's rendering of them)."""
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(call_text(c["function"]["name"], c["function"]["arguments"])
                              for c in m["tool_calls"])
            text = f"{m['content']}\n{calls}" if m.get("content") else calls
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_responses"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_responses": True})
        else:
            out.append(m)
    return [{k: v for k, v in m.items() if k != "_responses"} for m in out]


_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}\Z")
_BASE62 = string.ascii_letters + string.digits


def mistral_id(call_id: str) -> str:
    """A tool call id as Mistral's templates require it (9 letters or digits; they raise
    on any other, such as OpenAI's `call_...`): the id itself where it is one, else 9
    base-62 digits of its SHA-256, so a call and the tool message answering it still
    pair (vLLM truncates them for Mistral models instead).

    >>> mistral_id("a1B2c3D4e"), len(mistral_id("call_0123456789abcdef"))
    ('a1B2c3D4e', 9)
    """
    if _MISTRAL_ID.match(call_id):
        return call_id
    n, digits = int.from_bytes(hashlib.sha256(call_id.encode("utf-8")).digest(), "big"), []
    for _ in range(9):
        n, r = divmod(n, 62)
        digits.append(_BASE62[r])
    return "".join(digits)


def mistral_ids(messages: list) -> list:
    """`messages` with every tool call id and tool_call_id as `mistral_id` writes it."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "id": mistral_id(c["id"])} for c in m["tool_calls"]]}
        if m.get("tool_call_id") is not None:
            m = {**m, "tool_call_id": mistral_id(m["tool_call_id"])}
        out.append(m)
    return out


def prepare(messages: list, tools: list | None, support: TemplateSupport):
    """(messages, tools keyword) for the template: `messages` as
    ChatMessage.for_template gives them, `tools` the offered ones as dicts (None: not
    offered). What the template does not write itself is written in the generic format:
    the tools as a system message (the first one's text, or a new one before the
    others), the history's calls by `polyfill`; a Mistral template that writes them
    gets their ids as it requires them (`mistral_ids`)."""
    if not support.calls and any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        messages = polyfill(messages)
    elif support.calls and support.syntax == "mistral":
        messages = mistral_ids(messages)
    if not tools or support.tools:
        return messages, tools or None
    block = fallback_system(tools)
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        text = f"{first['content']}\n\n{block}" if first["content"] else block
        return [{**first, "content": text}, *messages[1:]], None
    return [{"role": "system", "content": block}, *messages], None


def call_grammar(tools: list, name: str | None = None, parallel: bool = True,
                 syntax: str = "hermes", tags: dict | None = None) -> str:
    """The Lark grammar (llguidance's, with its %json) of what "required" (`name` None)
    or a named tool_choice allows, in `syntax`: hermes, a <tool_call> block (or, with
    `parallel`, several, a newline apart) whose JSON is {"name": one of the tools (that
    one), "arguments": valid for its parameters}; llama3_json, such objects with
    "parameters" for "arguments", "; " between them; mistral, `[TOOL_CALLS]` and a JSON
    list of them (one item without `parallel`). `tools` are protocol.Tool. `tags`
    ({text: token id}) are the syntax's tags that are special tokens of the vocabulary:
    written as that token (llguidance's `<[id]>`), not spelled out as text."""
    tags = tags or {}

    def lit(text: str) -> str:
        return f"<[{tags[text]}]>" if text in tags else json.dumps(text)
    chosen = [t.function for t in tools if name is None or t.function.name == name]
    key = "parameters" if syntax == "llama3_json" else "arguments"
    schemas = [{"type": "object", "properties": {"name": {"const": f.name}, key: f.schema()},
                "required": ["name", key], "additionalProperties": False}
               for f in chosen]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if syntax == "mistral":
        listed = {"type": "array", "items": schema, "minItems": 1,
                  **({} if parallel else {"maxItems": 1}), "x-guidance": JSON_OPTIONS}
        return f"start: {lit(MISTRAL_TAG)} \" \" %json {json.dumps(listed)}\n"
    schema = {**schema, "x-guidance": JSON_OPTIONS}
    if syntax == "llama3_json":
        call, sep = f"call: %json {json.dumps(schema)}", json.dumps("; ")
    else:
        call = f"call: {lit(OPEN)} \"\\n\" %json {json.dumps(schema)} \"\\n\" {lit(CLOSE)}"
        sep = json.dumps("\n")
    return (f"start: call ({sep} call)*\n" if parallel else "start: call\n") + call + "\n"


def openai_call(name: str, arguments: dict) -> dict:
    """A parsed call as OpenAI's tool_calls entry (arguments as JSON text)."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


class ToolParser:
    """Splits generated text, as it comes, into content and calls: `push(text)` and, at
    the end, `flush()` return [("content", text) | ("call", (name, arguments))]. In the
    hermes syntax, text that may begin a <tool_call> is held until it does not; a block
    is a call when it closes with a JSON object naming one of `names` (its `arguments`
    an object, or absent: {}), else it is content. In llama3_json, an answer whose first
    text is `{` or `<|python_tag|>` is held to the end and is calls if it parses as
    such, else content; in mistral, the text from `[TOOL_CALLS]` on likewise. Content is
    trimmed as a whole (no leading or trailing whitespace: what separates calls is not
    content). With `parallel` False only the first call is kept (later ones are
    dropped)."""

    def __init__(self, names, parallel: bool = True, syntax: str = "hermes"):
        if syntax not in SYNTAXES:
            raise ValueError(f"unknown tool-call syntax {syntax!r}; one of {SYNTAXES}")
        self.names, self.parallel, self.syntax = set(names), parallel, syntax
        self.buffer, self.space, self.started, self.calls = "", "", False, 0
        self.held = False           # llama3_json / mistral: the rest is a call candidate

    def push(self, text: str) -> list:
        if self.syntax == "llama3_json":
            return self._push_llama3(text)
        if self.syntax == "mistral":
            return self._push_mistral(text)
        self.buffer += text
        out = []
        while True:
            if self.buffer.startswith(OPEN):
                end = self.buffer.find(CLOSE)
                if end < 0:
                    return out
                end += len(CLOSE)
                block, self.buffer = self.buffer[:end], self.buffer[end:]
                call = self._call(block)
                if call is None:
                    self._content(block, out)
                elif self.parallel or not self.calls:
                    out.append(("call", call))
                    self.calls += 1
                continue
            at = self.buffer.find(OPEN)
            if at < 0:          # keep a tail that may begin OPEN
                at = len(self.buffer)
                for k in range(min(len(OPEN) - 1, len(self.buffer)), 0, -1):
                    if self.buffer.endswith(OPEN[:k]):
                        at -= k
                        break
            self._content(self.buffer[:at], out)
            self.buffer = self.buffer[at:]
            if not self.buffer.startswith(OPEN):
                return out

    def flush(self) -> list:
        out = []
        if self.held:
            calls = (_llama3_calls if self.syntax == "llama3_json" else _mistral_calls)(
                self.buffer, self.names)
            if calls is not None:
                for call in calls[:None if self.parallel else 1]:
                    out.append(("call", call))
                    self.calls += 1
                self.buffer = ""
        self._content(self.buffer, out)
        self.buffer = ""
        return out

    def _push_llama3(self, text: str) -> list:
        """llama3_json: the answer's first text decides (a call starts with `{` or the
        python tag); leading whitespace and a prefix of the tag are held for it."""
        self.buffer += text
        if self.held:
            return []
        if not self.started:
            head = self.buffer.lstrip()
            if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
                return []
            if head.startswith("{") or head.startswith(PYTHON_TAG):
                self.held = True
                return []
        out = []
        self._content(self.buffer, out)
        self.buffer = ""
        return out

    def _push_mistral(self, text: str) -> list:
        """mistral: content up to `[TOOL_CALLS]` (a tail that may begin it held), the
        rest held to the end."""
        self.buffer += text
        if self.held:
            return []
        out = []
        at = self.buffer.find(MISTRAL_TAG)
        if at >= 0:
            self._content(self.buffer[:at], out)
            self.buffer, self.held = self.buffer[at:], True
            return out
        at = len(self.buffer)
        for k in range(min(len(MISTRAL_TAG) - 1, len(self.buffer)), 0, -1):
            if self.buffer.endswith(MISTRAL_TAG[:k]):
                at -= k
                break
        self._content(self.buffer[:at], out)
        self.buffer = self.buffer[at:]
        return out

    def _call(self, block: str):
        m = _BLOCK.match(block)
        try:
            obj = json.loads(m.group(1)) if m else None
        except ValueError:
            return None
        return _named_call(obj, self.names)

    def _content(self, text: str, out: list) -> None:
        text = self.space + text
        if not self.started:
            text = text.lstrip()
        kept = text.rstrip()
        self.space = text[len(kept):]
        if kept:
            self.started = True
            out.append(("content", kept))


def _named_call(obj, names, key: str = "arguments"):
    """(name, arguments) of a parsed call object naming one of `names`, its arguments
    under `key` (else "arguments" or "parameters", else {}) an object or JSON text of
    one (some models write them as text); None if it is not such a call."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return (obj["name"], args) if isinstance(args, dict) else None


_DECODER = json.JSONDecoder()


def _json_values(text: str, sep: str):
    """The JSON values of `text` one after another, `sep` (and whitespace) between them;
    None unless the whole text is such values."""
    values, at = [], 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            return values or None
        if values:
            if not text.startswith(sep, at):
                return None
            at += len(sep)
            while at < len(text) and text[at].isspace():
                at += 1
        try:
            value, at = _DECODER.raw_decode(text, at)
        except ValueError:
            return None
        values.append(value)


def _llama3_calls(text: str, names):
    """Llama 3.1's calls: an optional `<|python_tag|>`, then `{"name", "parameters"}`
    objects separated by ";"; None unless every one is a call of `names`."""
    text = text.strip()
    if text.startswith(PYTHON_TAG):
        text = text[len(PYTHON_TAG):]
    calls = [_named_call(o, names, "parameters") for o in _json_values(text, ";") or ()]
    return calls if calls and None not in calls else None


def _mistral_calls(text: str, names):
    """Mistral's calls after `[TOOL_CALLS]`: a JSON list of {"name", "arguments"}
    (v0.3), or `name[ARGS]{...}` calls each after its own tag (v11); None unless every
    one is a call of `names`."""
    parts = [p.strip() for p in text.split(MISTRAL_TAG)[1:]]
    if len(parts) == 1 and parts[0].startswith("["):
        listed = _json_values(parts[0], ",")
        if not listed or len(listed) != 1 or not isinstance(listed[0], list):
            return None
        calls = [_named_call(o, names) for o in listed[0]]
    else:
        calls = []
        for p in parts:
            name, tag, args = p.partition(MISTRAL_ARGS)
            obj = _json_values(args, ",") if tag else None
            calls.append(_named_call({"name": name.strip(), "arguments": obj[0]}, names)
                         if obj and len(obj) == 1 else None)
    return calls if calls and None not in calls else None


def split(text: str, names, parallel: bool = True, syntax: str = "hermes"):
    """(content or None, [(name, arguments)]) of a whole answer."""
    p = ToolParser(names, parallel, syntax)
    events = p.push(text) + p.flush()
    content = "".join(v for k, v in events if k == "content")
    return content or None, [v for k, v in events if k == "call"]
