"""The request bodies of OpenAI's completions, chat completions and embeddings APIs, as
pydantic models (FastAPI validates every body against them before a handler runs), and
the OpenAI error body.

Fields are OpenAI's names and defaults (temperature 1, top_p 1, completions' max_tokens
16), each nullable where OpenAI's is (null is the default). Extensions that vLLM also
accepts: `top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`, `ignore_eos`;
llama-server's `parse_special`. Log-probabilities: completions' `logprobs=N` (and
`echo`, which with `logprobs` scores the prompt too; `max_tokens=0` prefills only: what
lm-evaluation-harness sends to score a continuation), chat's `logprobs` /
`top_logprobs`. Structured output: `response_format` (json_object, json_schema), vLLM's
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, llama-server's
`json_schema` / `grammar` (GBNF). Tool calling (chat): `tools`,
`tool_choice`, `parallel_tool_calls`, assistant `tool_calls` and `tool` messages in the
history (serve.tools). Fields
this server does not implement (`REFUSED`: the legacy `functions`, OpenAI's `audio`,
`modalities` and `web_search_options`, vLLM's `structured_outputs`, beam search, ...)
are refused with a 400 naming the field unless they hold their default, rather than
silently ignored; unknown fields (and OpenAI's hints that change no answer here:
`store`, `metadata`, `service_tier`, `prediction`, `reasoning_effort`, ...) are
ignored, as OpenAI's SDKs send new ones.
"""
from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

import jsonschema

from pydantic import (BaseModel, ConfigDict, Field, StrictInt, field_validator,
                      model_validator)

from ..runtime.sampling import MAX_LOGPROBS

#: the most stop strings / stop ids one request may give
MAX_STOP = 16
#: the most prompts one completions request may batch, and the most choices (prompts
#: times n or best_of) one request may ask for
MAX_PROMPTS = 64
#: the largest n / best_of
MAX_N = 16
#: completions' max_tokens when it is left out or null (OpenAI's default)
COMPLETION_MAX_TOKENS = 16
#: the most inputs one embeddings request may hold (OpenAI's limit)
MAX_EMBED_INPUTS = 2048

TokenIds = list[StrictInt]

#: fields of OpenAI's API, vLLM's or llama-server's that this server does not implement,
#: with the values that ask for nothing (null, false, 0, empty, and these)
REFUSED = {
    "suffix": (), "functions": (), "function_call": ("none",),
    "structured_outputs": (), "use_beam_search": (),
    "min_tokens": (), "bad_words": (), "allowed_token_ids": (), "prompt_logprobs": (),
    "typical_p": (1, 1.0), "mirostat": (), "suffix_prompt": (),
    # OpenAI's chat: spoken answers, web search (an empty object asks for it)
    "audio": (), "modalities": (["text"],), "web_search_options": (),
}
#: REFUSED fields where an empty value asks for something too: only null passes
NULL_ONLY = {"audio", "web_search_options"}


def _refuse(cls, value, info):
    """A field this server does not implement: only a value that asks for nothing."""
    if value is None or value in REFUSED[info.field_name] or (
            info.field_name not in NULL_ONLY and value in (False, 0, "", [], {})):
        return value
    raise ValueError(f"{info.field_name}={value!r:.80} is not supported by this server")


class StreamOptions(BaseModel):
    include_usage: Optional[bool] = False


class _Refused(BaseModel):
    """The REFUSED fields, each a 400 naming it unless it asks for nothing."""
    model_config = ConfigDict(extra="ignore")

    suffix: Any = None
    functions: Any = None
    function_call: Any = None
    structured_outputs: Any = None
    use_beam_search: Any = None
    min_tokens: Any = None
    bad_words: Any = None
    allowed_token_ids: Any = None
    prompt_logprobs: Any = None
    typical_p: Any = None
    mirostat: Any = None
    suffix_prompt: Any = None
    audio: Any = None
    modalities: Any = None
    web_search_options: Any = None

    _refused = field_validator(*REFUSED)(classmethod(_refuse))


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, json_object, or json_schema ({"name", "schema",
    "strict"}), enforced by serve.structured."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[dict] = None

    @field_validator("json_schema")
    @classmethod
    def _schema(cls, v, info):
        if v is not None and not isinstance(v.get("schema", {}), dict):
            raise ValueError("json_schema.schema must be a JSON schema (an object)")
        return v


class _Sampling(_Refused):
    """What both endpoints share."""

    model: str
    temperature: Optional[float] = Field(1.0, ge=0.0)
    top_p: Optional[float] = Field(1.0, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=-1, description="-1 or 0: off (vLLM's convention)")
    min_p: Optional[float] = Field(0.0, ge=0.0, le=1.0)
    seed: Optional[StrictInt] = Field(None, ge=0, lt=1 << 63)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[StrictInt]] = Field(None, max_length=MAX_STOP)
    ignore_eos: Optional[bool] = False
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[StrictInt] = Field(1, ge=1, le=MAX_N)
    presence_penalty: Optional[float] = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: Optional[float] = Field(1.0, gt=0.0, le=100.0)
    logit_bias: Optional[dict[str, float]] = Field(None, max_length=1024)
    parse_special: Optional[bool] = False
    response_format: Optional[ResponseFormat] = None
    # the grammar extensions of vLLM (guided_*) and llama-server (json_schema, grammar)
    guided_json: Optional[Union[dict, str]] = None
    guided_regex: Optional[str] = Field(None, max_length=1 << 16)
    guided_choice: Optional[list[str]] = Field(None, max_length=1024)
    guided_grammar: Optional[str] = Field(None, max_length=1 << 20)
    json_schema: Optional[dict] = None
    grammar: Optional[str] = Field(None, max_length=1 << 20)
    user: Optional[str] = None

    @field_validator("response_format")
    @classmethod
    def _needs_schema(cls, v):
        if v is not None and v.type == "json_schema" and v.json_schema is None:
            raise ValueError("type json_schema needs json_schema: {\"name\", \"schema\"}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        v = [v] if isinstance(v, str) else v
        if v is not None and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        """{"token id": bias} as {int: float}, each bias in [-100, 100] (OpenAI's range)."""
        if v is None:
            return v
        out = {}
        for key, bias in v.items():
            if not key.isdigit() or len(key) > 9:
                raise ValueError(f"keys must be token ids, got {key!r:.40}")
            if not -100 <= bias <= 100:
                raise ValueError(f"the bias of token {key} must be from -100 to 100, got {bias}")
            out[int(key)] = float(bias)
        return out

    @property
    def k(self) -> Optional[int]:
        return self.top_k if self.top_k and self.top_k > 0 else None

    @property
    def choices(self) -> int:
        """Choices per prompt."""
        return self.n or 1

    def constraint(self):
        """(field, kind, value) of the one structured-output field set ("json": a schema
        or None for any object, "regex", "choice", "grammar": GBNF or Lark), or None;
        ValueError naming them when several are."""
        rf = self.response_format
        given = [("response_format", "json", None if rf.type == "json_object"
                  else (rf.json_schema or {}).get("schema", {}))] \
            if rf is not None and rf.type != "text" else []
        for name, kind in (("guided_json", "json"), ("json_schema", "json"),
                           ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar"), ("grammar", "grammar")):
            v = getattr(self, name)
            if v:
                given.append((name, kind, v))
        if len(given) > 1:
            raise ValueError(f"{given[1][0]}: only one of {', '.join(g[0] for g in given)} "
                             f"may constrain the output")
        return given[0] if given else None

    def sampling(self) -> dict:
        """The Engine.submit keywords of the sampling fields."""
        return {"top_k": self.k, "top_p": self.top_p, "min_p": self.min_p or 0.0,
                "presence_penalty": self.presence_penalty or 0.0,
                "frequency_penalty": self.frequency_penalty or 0.0,
                "repetition_penalty": 1.0 if self.repetition_penalty is None
                else self.repetition_penalty, "logit_bias": self.logit_bias}


class CompletionRequest(_Sampling):
    """POST /v1/completions: `prompt` is text, a list of token ids, or a list of either
    (n choices each)."""
    prompt: Union[str, TokenIds, list[str], list[TokenIds]]
    max_tokens: Optional[StrictInt] = Field(COMPLETION_MAX_TOKENS, ge=0,
                                            description="0: score the prompt only")
    echo: Optional[bool] = False
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: Optional[StrictInt] = Field(None, ge=1, le=MAX_N)
    add_special_tokens: Optional[bool] = True
    tools: Any = None               # chat's: refused here
    tool_choice: Any = None

    @field_validator("tools", "tool_choice")
    @classmethod
    def _chat_only(cls, v, info):
        if v is None or v in ([], "none"):
            return v
        raise ValueError(f"{info.field_name} is for /v1/chat/completions, not completions")

    @field_validator("prompt")
    @classmethod
    def _few_prompts(cls, p):
        if isinstance(p, list) and p and not isinstance(p[0], int) and len(p) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts in one request")
        return p

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v, info):
        if v is not None and v < (info.data.get("n") or 1):
            raise ValueError(f"best_of must be at least n ({info.data.get('n')}), got {v}")
        if v is not None and v > (info.data.get("n") or 1) and info.data.get("stream"):
            raise ValueError("best_of > n cannot be streamed (as OpenAI's API)")
        return v

    @property
    def candidates(self) -> int:
        """Sequences generated per prompt (best_of, else n)."""
        return self.best_of or self.choices

    def prompts(self) -> list:
        """The prompts: each a str or a list of ids."""
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return [p]
        return list(p)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


#: OpenAI's rule for function names
FUNCTION_NAME = r"^[A-Za-z0-9_.-]{1,64}$"
#: the most tools one request may offer (OpenAI's limit)
MAX_TOOLS = 128


class FunctionDef(BaseModel):
    """A tool's function: `parameters` is the JSON schema of its arguments (none: it
    takes no arguments), checked against its JSON Schema draft."""
    name: str = Field(pattern=FUNCTION_NAME)
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None

    @field_validator("parameters")
    @classmethod
    def _schema(cls, v):
        if v is None:
            return v
        try:
            jsonschema.validators.validator_for(v).check_schema(v)
        except jsonschema.SchemaError as e:
            raise ValueError(f"parameters is not a valid JSON schema: {e.message} "
                             f"(at {'/'.join(map(str, e.path)) or 'the top'})") from None
        return v

    def schema(self) -> dict:
        """The JSON schema of the arguments (an object)."""
        return self.parameters if self.parameters is not None else \
            {"type": "object", "properties": {}}


class Tool(BaseModel):
    """One entry of `tools`: {"type": "function", "function": {"name", "description",
    "parameters"}}."""
    type: Literal["function"]
    function: FunctionDef


class _Named(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """tool_choice {"type": "function", "function": {"name"}}: call that tool."""
    type: Literal["function"]
    function: _Named


class FunctionCall(BaseModel):
    name: str
    arguments: str      # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """An assistant message's tool call in the history."""
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: str
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None

    @model_validator(mode="after")
    def _tool_roles(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls are an assistant message's (role: assistant)")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        """The message as transformers hands it to a chat template: role and content
        (text), the tool calls with their arguments as objects (where the text is a
        JSON object: what templates write with `tojson`, as vLLM passes them), and a
        tool message's tool_call_id (and name)."""
        d = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            d["name"] = self.name
        return d


def _arguments(text: str):
    """Arguments text as an object where it is a JSON object, else the text."""
    try:
        v = json.loads(text)
    except ValueError:
        return text
    return v if isinstance(v, dict) else text


class ChatRequest(_Sampling):
    """POST /v1/chat/completions: `messages` rendered by the model's chat template."""
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[StrictInt] = Field(None, ge=1)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_LOGPROBS)
    add_special_tokens: Optional[bool] = False
    tools: Optional[list[Tool]] = Field(None, max_length=MAX_TOOLS)
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = None

    @field_validator("tools")
    @classmethod
    def _distinct_tools(cls, v):
        names = [t.function.name for t in v or ()]
        twice = next((n for n in names if names.count(n) > 1), None)
        if twice is not None:
            raise ValueError(f"two tools are named {twice!r}")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _choice_needs_tools(cls, v, info):
        if v is None or v == "none":
            return v
        tools = info.data.get("tools")
        if not tools:
            raise ValueError(f"tool_choice {v if isinstance(v, str) else 'function'!r} needs "
                             f"`tools` (a list of functions)")
        if isinstance(v, NamedToolChoice):
            names = [t.function.name for t in tools]
            if v.function.name not in names:
                raise ValueError(f"tool_choice names function {v.function.name!r:.80}, which "
                                 f"is not in tools ({', '.join(names)[:200]})")
        return v

    def tool_mode(self):
        """None (no tools offered: none given, or tool_choice "none"), "auto",
        "required", or the name of the function that must be called."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice or "auto"

    @field_validator("add_special_tokens")
    @classmethod
    def _template_writes_them(cls, v):
        if v:
            raise ValueError("add_special_tokens=true is not supported in chat: the chat "
                             "template writes the special tokens")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v, info):
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs=true")
        return v


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings: `input` is a text, a list of texts, a list of token ids, or a
    list of token-id lists (at most MAX_EMBED_INPUTS, none empty); `dimensions` keeps
    the first that many (Matryoshka truncation); `encoding_format` "float" (JSON
    numbers) or "base64" (little-endian float32 bytes, what OpenAI's client asks for by
    default); `user` is accepted and ignored, as OpenAI does."""
    model_config = ConfigDict(extra="ignore")

    input: Union[str, list[str], TokenIds, list[TokenIds]]
    model: str
    dimensions: Optional[StrictInt] = Field(None, ge=1)
    encoding_format: Optional[Literal["float", "base64"]] = "float"
    user: Optional[str] = None

    @field_validator("input")
    @classmethod
    def _inputs(cls, v):
        if isinstance(v, str) or (v and isinstance(v[0], int)):
            v = [v]
        if not v:
            raise ValueError("input must not be empty")
        if len(v) > MAX_EMBED_INPUTS:
            raise ValueError(f"at most {MAX_EMBED_INPUTS} inputs in one request")
        empty = next((k for k, x in enumerate(v) if not x), None)
        if empty is not None:
            raise ValueError(f"input {empty} is empty")
        return v


class TokenizeRequest(BaseModel):
    """POST /tokenize, in llama-server's shape (`content`; `add_special`, default false,
    adds the tokenizer's BOS; `with_pieces` returns each token's text) or vLLM's
    (`prompt`; `add_special_tokens`, default true). `parse_special` matches special
    tokens in the text (off by default here: text is text, as in the completions)."""
    model_config = ConfigDict(extra="ignore")

    content: Optional[str] = Field(None, max_length=1 << 20)
    prompt: Optional[str] = Field(None, max_length=1 << 20)
    add_special: Optional[bool] = False
    add_special_tokens: Optional[bool] = True
    parse_special: Optional[bool] = False
    with_pieces: Optional[bool] = False
    messages: Any = None        # vLLM's chat form: refused

    @field_validator("messages")
    @classmethod
    def _no_chat(cls, v):
        if v is not None:
            raise ValueError("tokenizing messages is not supported: pass `content` (or "
                             "`prompt`) text")
        return v

    @field_validator("prompt")
    @classmethod
    def _one_text(cls, v, info):
        if v is not None and info.data.get("content") is not None:
            raise ValueError("pass `content` (llama-server) or `prompt` (vLLM), not both")
        return v

    def text(self) -> tuple:
        """(the text, its field, whether to add the tokenizer's special tokens)."""
        if self.prompt is not None:
            return self.prompt, "prompt", self.add_special_tokens is not False
        if self.content is None:
            raise ValueError("content: the text to tokenize is missing")
        return self.content, "content", bool(self.add_special)


class DetokenizeRequest(BaseModel):
    """POST /detokenize (llama-server's and vLLM's): `tokens` as ids."""
    tokens: list[StrictInt] = Field(max_length=1 << 20)


def error_body(message: str, type: str = "invalid_request_error", param=None, code=None) -> dict:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
