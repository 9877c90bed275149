"""The request bodies of OpenAI's completions and chat completions APIs, as pydantic
models (FastAPI validates every body against them before a handler runs), and the
OpenAI error body.

Fields are OpenAI's names and defaults (temperature 1, top_p 1, completions' max_tokens
16). Extensions that vLLM also accepts: `top_k`, `stop_token_ids`, `ignore_eos`.
Log-probabilities: completions' `logprobs=N` (and `echo`, which with `logprobs` scores
the prompt too; `max_tokens=0` prefills only: what lm-evaluation-harness sends to score
a continuation), chat's `logprobs` / `top_logprobs`. Fields OpenAI defines but this
server does not implement (n > 1, suffix, penalties, logit_bias, tools) are refused
with a 400 naming the field rather than silently ignored; unknown fields are ignored,
as OpenAI's SDKs send new ones.
"""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from ..runtime.sampling import MAX_LOGPROBS

#: the most stop strings / stop ids one request may give
MAX_STOP = 16
#: the most prompts one completions request may batch
MAX_PROMPTS = 64

TokenIds = list[StrictInt]


def _refuse(cls, value, info):
    """A field OpenAI defines and this server does not implement: only its default."""
    if value and not (info.field_name == "best_of" and value == 1):
        raise ValueError(f"{info.field_name}={value!r} is not supported by this server")
    return value


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """What both endpoints share."""
    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: Optional[float] = Field(1.0, ge=0.0)
    top_p: Optional[float] = Field(1.0, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=-1, description="-1 or 0: off (vLLM's convention)")
    seed: Optional[StrictInt] = Field(None, ge=0, lt=1 << 63)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[StrictInt]] = Field(None, max_length=MAX_STOP)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(1, ge=1, le=1, description="one choice per prompt")
    presence_penalty: Optional[float] = 0.0
    frequency_penalty: Optional[float] = 0.0
    logit_bias: Optional[dict] = None
    user: Optional[str] = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        v = [v] if isinstance(v, str) else v
        if v is not None and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        return v

    @property
    def k(self) -> Optional[int]:
        return self.top_k if self.top_k and self.top_k > 0 else None


class CompletionRequest(_Sampling):
    """POST /v1/completions: `prompt` is text, a list of token ids, or a list of either
    (one choice each)."""
    prompt: Union[str, TokenIds, list[str], list[TokenIds]]
    max_tokens: Optional[StrictInt] = Field(16, ge=0, description="0: score the prompt only")
    echo: Optional[bool] = False
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    @field_validator("prompt")
    @classmethod
    def _few_prompts(cls, p):
        if isinstance(p, list) and p and not isinstance(p[0], int) and len(p) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts in one request")
        return p

    _unsupported = field_validator("suffix", "best_of", "presence_penalty",
                                   "frequency_penalty", "logit_bias")(classmethod(_refuse))

    def prompts(self) -> list:
        """One prompt per choice: a str or a list of ids."""
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return [p]
        return list(p)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: str
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(_Sampling):
    """POST /v1/chat/completions: `messages` rendered by the model's chat template."""
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[StrictInt] = Field(None, ge=1)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Optional[list] = None

    _unsupported = field_validator("tools", "presence_penalty", "frequency_penalty",
                                   "logit_bias")(classmethod(_refuse))

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v, info):
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs=true")
        return v


def error_body(message: str, type: str = "invalid_request_error", param=None, code=None) -> dict:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
