"""The OpenAI-compatible HTTP API over an Engine (runtime.scheduler): a FastAPI app.

    GET  /v1/models                the one model served
    POST /v1/completions           prompt: text, token ids, or a list of either
    POST /v1/chat/completions      messages rendered by the model's chat template
    POST /tokenize, /detokenize    llama-server's and vLLM's: text to ids and back
    GET  /tokenizer_info           vLLM's: special tokens and the chat template
    GET  /health                   200 while the engine runs, else 503
    GET  /metrics                  Prometheus text (serve.metrics)

Sampling (n, best_of, penalties, logit_bias, min_p), log-probabilities and structured
output (serve.structured) are per request in the engine; text is text
(models.tokenizer.TextEncoder: special tokens only from the chat template, or where
`parse_special` asks).

`stream: true` answers with server-sent events (`data: {chunk}\\n\\n` ..., `data:
[DONE]\\n\\n`), as OpenAI streams them. Every error is OpenAI's JSON error body with
a 4xx/5xx status: 401 (API key), 400 (a body that fails validation, a prompt longer
than the context, ids out of range, ...), 404 (another model's name), 413 (a body over
`max_body` bytes), 429 (the engine's queue is full), 503 (the engine stopped). A
client that goes away has its request cancelled: the engine frees its slot at its
next step.

The engine's thread owns the device; each request's tokens are carried from that
thread to the event loop by one small thread per request (Request iteration blocks),
so the loop never waits on the engine.

    >>> engine = Engine(tc.load("model.tcm"))
    >>> app = create_app(engine, "model", api_key="secret")
    >>> uvicorn.run(app, host="127.0.0.1", port=8000)
"""
from __future__ import annotations

import asyncio
import hmac
import json
import re
import secrets
import threading
import time
import uuid
from typing import NamedTuple

import anyio
import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import InputError, TercompError
from ..models.chat import ChatTemplate, ChatTemplateError
from ..models.tokenizer import TextEncoder
from ..runtime.scheduler import EngineClosed, QueueFull
from .metrics import CONTENT_TYPE, Metrics
from .protocol import (MAX_PROMPTS, ChatRequest, CompletionRequest, DetokenizeRequest,
                       TokenizeRequest, error_body)
from .structured import GrammarError, Grammars
from .text import TextStream, TokenPieces

#: the largest request body accepted, in bytes (create_app's max_body)
MAX_BODY = 1 << 20
#: seconds a request body may take to arrive (a 408 after)
READ_TIMEOUT = 10.0
#: the most tokens one request may generate over all its prompts and choices
MAX_REQUEST_TOKENS = 1 << 15
#: prompts tokenized at once (the others wait, off the event loop)
TOKENIZING = 4

_END = object()


class APIError(Exception):
    """An error answered as OpenAI's JSON error body with `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param=None, code=None):
        super().__init__(message)
        self.status, self.body = status, error_body(message, type, param, code)


def create_app(engine, model_name: str, api_key: str | None = None,
               max_body: int = MAX_BODY, read_timeout: float = READ_TIMEOUT,
               max_request_tokens: int = MAX_REQUEST_TOKENS) -> FastAPI:
    """The FastAPI app serving `engine` (a runtime.Engine) as `model_name`. With
    `api_key`, every /v1 request needs `Authorization: Bearer <api_key>` (/health and
    /metrics stay open, for load balancers and scrapers). A body must arrive within
    `read_timeout` seconds; one request may generate `max_request_tokens` tokens over
    all its prompts and choices. The caller owns the engine (closes it after the
    server stops)."""
    model = _Model(engine.model)
    tokenizing = anyio.CapacityLimiter(TOKENIZING)

    async def off_loop(fn, *args):
        """Tokenization off the event loop, a few at a time (the rest wait their turn
        without holding threads the other endpoints need)."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=tokenizing)
    metrics = Metrics(engine)
    created = int(time.time())
    app = FastAPI(title="tercomp", summary=f"OpenAI-compatible API serving {model_name}")
    app.state.engine, app.state.metrics = engine, metrics
    app.add_middleware(_Guard, api_key=api_key, max_body=max_body, metrics=metrics,
                       read_timeout=read_timeout)
    _add_error_handlers(app)

    def check_model(name: str):
        if name != model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves "
                                f"`{model_name}`", param="model", code="model_not_found")

    @app.get("/health")
    async def health():
        s = engine.stats()
        body = {"status": "ok" if engine.alive else "stopped", "model": model_name,
                **{k: s[k] for k in ("slots", "free_slots", "running", "waiting")}}
        return JSONResponse(body, status_code=200 if engine.alive else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def model_card():
        return {"id": model_name, "object": "model", "created": created, "owned_by": "tercomp",
                "max_model_len": model.max_seq}

    @app.get("/v1/models")
    def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    def get_model(name: str):
        check_model(name)
        return model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        texts = body.prompts()
        for t in texts:
            model.check_length(t, "prompt")
        prompts = await off_loop(lambda: [
            model.encode(p, bool(body.parse_special), body.add_special_tokens is not False)
            for p in texts])
        max_tokens = _budget(body.max_tokens, len(texts) * body.candidates, model.max_seq,
                             max_request_tokens)
        echo = [(t if isinstance(t, str) else model.decode(t), p) if body.echo else None
                for t, p in zip(texts, prompts)]
        grammar = await _grammar(model, body, off_loop)
        rid = f"cmpl-{uuid.uuid4().hex}"
        runs = _submit(engine, model, body, prompts, [max_tokens] * len(prompts), "prompt",
                       logprobs=body.logprobs, echo=echo, candidates=body.candidates, group=rid,
                       grammar=grammar)
        head = {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": model_name}

        def choice(i, run, piece, finish):
            lp = None if body.logprobs is None else \
                model.completion_logprobs(run, piece.logged, piece.scores)
            return {"index": i, "text": piece.text, "logprobs": lp, "finish_reason": finish,
                    "token_ids": piece.ids}

        if body.stream:
            return _sse(runs, request, metrics, head, choice, _include_usage(body))
        await _collect(runs, request, metrics)
        best = _best(runs, body.choices)
        return {**head, "choices": [choice(i, r, r.whole(), r.finish_reason)
                                    for i, r in enumerate(best)], "usage": _usage(runs)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        check_model(body.model)
        model.check_length("".join(m.text() for m in body.messages), "messages")
        prompt = await off_loop(model.render_chat, body.messages, bool(body.parse_special))
        limit = _budget(body.max_completion_tokens or body.max_tokens, body.choices,
                        model.max_seq, max_request_tokens, "max_completion_tokens"
                        if body.max_completion_tokens else "max_tokens")
        top = (body.top_logprobs or 0) if body.logprobs else None
        grammar = await _grammar(model, body, off_loop)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        runs = _submit(engine, model, body, [prompt], [limit], "messages", logprobs=top,
                       candidates=body.choices, group=rid, grammar=grammar)
        head = {"id": rid, "object": "chat.completion",
                "created": int(time.time()), "model": model_name}

        def logprobs(piece):
            return None if top is None else \
                {"content": model.chat_logprobs(piece.logged, piece.scores)}

        if body.stream:
            def delta(i, run, piece, finish):
                d = {} if finish else {"content": piece.text}
                return {"index": i, "delta": d, "logprobs": None if finish else logprobs(piece),
                        "finish_reason": finish}
            first = [{"index": i, "delta": {"role": "assistant", "content": ""},
                      "logprobs": None, "finish_reason": None} for i in range(len(runs))]
            return _sse(runs, request, metrics, {**head, "object": "chat.completion.chunk"},
                        delta, _include_usage(body), first=first)
        await _collect(runs, request, metrics)

        def message(i, r):
            whole = r.whole()
            return {"index": i, "logprobs": logprobs(whole), "finish_reason": r.finish_reason,
                    "message": {"role": "assistant", "content": whole.text}}
        return {**head, "choices": [message(i, r) for i, r in enumerate(runs)],
                "usage": _usage(runs)}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        """llama-server's /tokenize ({"tokens": [id, ...]}, or with `with_pieces`
        {"tokens": [{"id", "piece"}]}, a piece that is not whole UTF-8 as its bytes) and
        vLLM's (`prompt` in; `count` and `max_model_len` out too)."""
        try:
            text, field, add = body.text()
        except ValueError as e:
            raise APIError(400, str(e), param="content") from None
        model.check_length(text, field)
        ids = await off_loop(model.encode, text, bool(body.parse_special), add, field)
        if not body.with_pieces:
            return {"tokens": ids, "count": len(ids), "max_model_len": model.max_seq}
        out = []
        for i in ids:
            b = model.pieces.bytes(i)
            try:
                piece = b.decode()
            except UnicodeDecodeError:
                piece = list(b)
            out.append({"id": i, "piece": piece})
        return {"tokens": out}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        """{"content": text} (llama-server's key), also as "prompt" (vLLM's)."""
        bad = [t for t in body.tokens if not 0 <= t < model.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of range for a vocabulary of "
                                f"{model.vocab_size}", param="tokens")
        if model.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", param="tokens")
        text = await off_loop(model.decode, body.tokens, False)
        return {"content": text, "prompt": text}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """vLLM's /tokenizer_info: the special tokens and the chat template (what
        lm-evaluation-harness's remote tokenizer reads)."""
        t = model.template
        return {"tokenizer_class": "tercomp", "eos_token": t.eos_token or None if t else None,
                "bos_token": t.bos_token or None if t else None, "pad_token": None,
                "chat_template": t.source if t else None, "model_max_length": model.max_seq,
                "vocab_size": model.vocab_size}

    return app


# -- the model's text side -------------------------------------------------------------------

class _Model:
    """What the API needs of the generator: its tokenizer, chat template and eos."""

    def __init__(self, gen):
        self.tokenizer, self.max_seq, self.vocab_size = gen.tokenizer, gen.max_seq, gen.vocab_size
        self.template = ChatTemplate.from_dict(gen.chat_template)
        eos = None
        if self.template is not None and self.template.eos_token and self.tokenizer is not None:
            eos = self.tokenizer.token_to_id(self.template.eos_token)
        self.eos = {eos} if eos is not None else set()
        self.pieces = TokenPieces(self.tokenizer)
        self.encoder = TextEncoder(self.tokenizer) if self.tokenizer is not None else None
        self.grammars = Grammars(self.tokenizer, self.vocab_size, next(iter(self.eos), None))
        # the most bytes a token covers: text of more than max_seq times it (twice, for
        # normalizers that shrink text) is over the context whatever its tokens
        n = self.tokenizer.get_vocab_size(with_added_tokens=True) if self.tokenizer else 0
        longest = max((len(self.pieces.bytes(i)) for i in range(n)), default=1)
        self.max_text_bytes = 2 * self.max_seq * max(longest, 1)

    def check_length(self, text, param: str) -> None:
        """A 400 for text too long for the context, before tokenizing it (its time is
        bounded by the bytes this lets through)."""
        if isinstance(text, str) and len(text) > self.max_text_bytes // 4 \
                and len(text.encode("utf-8", "surrogatepass")) > self.max_text_bytes:
            raise APIError(400, f"This model's maximum context length is {self.max_seq} "
                                f"tokens; the text has over {self.max_text_bytes} bytes, more "
                                f"than that many tokens cover", param=param,
                           code="context_length_exceeded")

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def completion_logprobs(self, run, ids, scores) -> dict:
        """OpenAI's completions `logprobs` of tokens `ids`: their strings, log-probabilities
        and most likely alternatives (with the token itself, as OpenAI adds it), and
        their offsets in the choice's text (run.offset carries on between chunks)."""
        tokens = [self.pieces.text(t) for t in ids]
        offsets = []
        for t in tokens:
            offsets.append(run.offset)
            run.offset += len(t)
        tops = []
        for t, s in zip(ids, scores):
            if s is None:
                tops.append(None)
                continue
            d = {self.pieces.text(a): _finite(lp) for a, lp in s[1]}
            d.setdefault(self.pieces.text(t), _finite(s[0]))
            tops.append(d)
        return {"tokens": tokens, "token_logprobs": [None if s is None else _finite(s[0])
                                                     for s in scores],
                "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, ids, scores) -> list:
        """OpenAI's chat `logprobs.content` entries of tokens `ids`."""
        def entry(t, lp):
            b = self.pieces.bytes(t)
            return {"token": self.pieces.text(t), "logprob": _finite(lp), "bytes": list(b)}
        return [{**entry(t, s[0]), "top_logprobs": [entry(a, lp) for a, lp in s[1]]}
                for t, s in zip(ids, scores)]

    def encode(self, prompt, parse_special: bool = False, add_special_tokens: bool = True,
               param: str = "prompt") -> list:
        """A prompt's ids: token ids as they are, text as text (special tokens only with
        `parse_special`)."""
        if not isinstance(prompt, str):
            return prompt
        if self.encoder is None:
            raise APIError(400, "this model has no tokenizer: pass the prompt as token ids",
                           param=param)
        return self.encoder.encode(prompt, parse_special, add_special_tokens)

    def render_chat(self, messages, parse_special: bool = False) -> list:
        """The ids of `messages` in the chat template: its special tokens are tokens, the
        messages' contents text (unless `parse_special`)."""
        if self.tokenizer is None or self.template is None:
            raise APIError(400, "this model's files carry no chat template (or no tokenizer): "
                                "use /v1/completions", param="messages")
        try:
            parts = self.template.render_parts(
                [{"role": m.role, "content": m.text()} for m in messages],
                add_generation_prompt=True)
        except ChatTemplateError as e:
            raise APIError(400, e.message, param="messages") from None
        return self.encoder.encode_parts(parts, parse_special)


def _finite(lp: float) -> float:
    """A log-probability as JSON can hold it (OpenAI's floor for -inf: -9999)."""
    return max(float(lp), -9999.0) if lp == lp else -9999.0


class _Run:
    """One submitted request (one choice) and its text. `echo`: (prompt text, prompt
    ids) to send before the generated text, or None; `offset`: the text offset of the
    next token's log-probability entry."""

    def __init__(self, req, text: TextStream, echo=None, prompt_index: int = 0):
        self.req, self.text, self.echo, self.offset = req, text, echo, 0
        self.prompt_index = prompt_index

    @property
    def finish_reason(self) -> str:
        if self.text.finished:
            return "stop"
        return self.req.finish_reason if self.req.finish_reason in ("stop", "length") else "abort"

    def piece(self, text: str, start: int, end: int) -> "_Piece":
        """The piece of generated tokens start..end with `text`."""
        ids = self.text.tokens[start:end]
        return _Piece(text, ids, ids, None if self.req.logprobs is None
                      else self.req.token_logprobs[start:end])

    def echoed(self) -> "_Piece":
        """The piece of the echoed prompt (its ids are scored, not generated)."""
        text, ids = self.echo
        scores = self.req.prompt_scores if self.req.prompt_logprobs is not None else None
        return _Piece(text, [], list(map(int, ids)), scores)

    def whole(self) -> "_Piece":
        """The whole choice once it ended, the echoed prompt first."""
        p = self.piece(self.text.text, 0, len(self.text.tokens))
        if self.echo is None:
            return p
        e = self.echoed()
        return _Piece(e.text + p.text, p.ids, e.logged + p.logged,
                      None if p.scores is None else list(e.scores or ()) + list(p.scores))


class _Piece(NamedTuple):
    """What one chunk carries: `text`, generated `ids`, the ids its log-probability
    entries are for (`logged`: the prompt's too when echoed) and those entries (None:
    not asked for)."""
    text: str
    ids: list
    logged: list
    scores: list | None



def _submit(engine, model: _Model, body, prompts, limits, param, logprobs=None,
            echo=None, candidates: int = 1, group=None, grammar=None) -> list:
    """Submit `candidates` requests per prompt (all or none: a refused one cancels the
    others), the j-th of a prompt seeded with seed + j. `logprobs`: the alternatives per
    generated token (None: no log-probabilities); `echo`: per prompt, (text, ids) to
    echo (the prompt scored too when `logprobs`)."""
    if len(prompts) * candidates > MAX_PROMPTS:
        raise APIError(400, f"{len(prompts)} prompts times {candidates} choices each is over "
                            f"{MAX_PROMPTS} sequences in one request", param="n")
    bad = [t for t in (body.logit_bias or ()) if t >= model.vocab_size]
    if bad:
        raise APIError(400, f"logit_bias: token id {bad[0]} is out of range for a vocabulary "
                            f"of {model.vocab_size}", param="logit_bias")
    if candidates > (body.n or 1) and logprobs is None:
        logprobs = 0                    # best_of ranks by the generated tokens' logprobs
    if body.stop and model.tokenizer is None:
        raise APIError(400, "stop strings need the model's tokenizer; this model has none",
                       param="stop")
    stop_ids = set(body.stop_token_ids or ()) | (set() if body.ignore_eos else model.eos)
    temperature = 1.0 if body.temperature is None else body.temperature
    seed = body.seed if body.seed is not None else secrets.randbits(63)
    runs = []
    echo = echo or [None] * len(prompts)
    try:
        for (index, prompt), limit, shown in zip(enumerate(prompts), limits, echo):
            if len(prompt) >= model.max_seq:
                raise APIError(400, f"This model's maximum context length is {model.max_seq} "
                                    f"tokens; the prompt has {len(prompt)}", param=param,
                               code="context_length_exceeded")
            for j in range(candidates):
                req = engine.submit(prompt, max_tokens=limit, temperature=temperature,
                                    seed=(seed + j) % (1 << 63), stop=stop_ids,
                                    logprobs=logprobs, group=group, **body.sampling(),
                                    constraint=grammar and grammar.constraint(),
                                    prompt_logprobs=logprobs if shown is not None else None)
                runs.append(_Run(req, TextStream(model.tokenizer, body.stop or (), stop_ids),
                                 shown, index))
    except BaseException as e:
        for r in runs:
            r.req.cancel()
        if isinstance(e, QueueFull):
            raise APIError(429, f"{e.message}: retry later", type="rate_limit_exceeded",
                           code="queue_full") from None
        if isinstance(e, EngineClosed):
            raise APIError(503, e.message, type="server_error", code="engine_stopped") from None
        if isinstance(e, InputError):
            raise APIError(400, f"{e.message}" + (f" ({e.hint})" if e.hint else ""),
                           param=param) from None
        raise
    return runs


async def _grammar(model: _Model, body, off_loop):
    """The compiled output constraint of a request (None without one), off the event
    loop (a large schema takes a while); a 400 naming the field when it cannot be
    enforced."""
    try:
        spec = body.constraint()
    except ValueError as e:
        raise APIError(400, str(e), param=str(e).split(":")[0]) from None
    if spec is None:
        return None
    field, kind, value = spec
    try:
        return await off_loop(model.grammars.compile, kind, value)
    except GrammarError as e:
        raise APIError(400, f"{field}: {e}", param=field) from None


def _budget(asked, sequences: int, max_seq: int, cap: int, param: str = "max_tokens") -> int:
    """Tokens per sequence: `asked` (None: as many as the context and the request's cap
    allow), a 400 when `sequences` of them are over the request's cap."""
    if asked is None:
        return max(1, min(max_seq, cap // sequences))
    if asked * sequences > cap:
        raise APIError(400, f"{sequences} sequences of {param}={asked} are "
                            f"{asked * sequences} tokens, over the {cap} one request may "
                            f"generate", param=param)
    return asked


def _best(runs, n: int) -> list:
    """Of each prompt's candidates, the `n` whose generated tokens are most likely (the
    sum of their log-probabilities: OpenAI's best_of), most likely first; all of them,
    in order, when there are n."""
    by_prompt: dict = {}
    for r in runs:
        by_prompt.setdefault(r.prompt_index, []).append(r)
    out = []
    for group in by_prompt.values():
        if len(group) > n:
            group = sorted(group, key=lambda r: -sum(s[0] for s in r.req.token_logprobs[
                :len(r.text.tokens)]))[:n]
        out.extend(group)
    return out


def _usage(runs) -> dict:
    """Prompt tokens once per prompt, every generated token (best_of's discarded ones
    too)."""
    prompt = sum(int(r.req.prompt.size) for r in {r.prompt_index: r for r in runs}.values())
    completion = sum(len(r.text.tokens) for r in runs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _include_usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


# -- from the engine's thread to the event loop ------------------------------------------------

async def _tokens(req):
    """The request's tokens as they come, without blocking the loop: a thread iterates
    the request (blocking) and hands each token to the loop."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def put(item):
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:            # the loop is closed: nobody reads this request
            req.cancel()

    def pump():
        try:
            for tok in req:
                put(tok)
            put(_END)
        except BaseException as e:
            put(e)

    threading.Thread(target=pump, name=f"tercomp-request-{req.id}", daemon=True).start()
    while True:
        item = await queue.get()
        if item is _END:
            return
        if isinstance(item, BaseException):
            raise item
        yield item


async def _pieces(run: _Run, metrics: Metrics):
    """The _Pieces of one run as they can be sent, the echoed prompt first (once it is prefilled: with the first token, or at
    the end); the request is cancelled when a stop string ends it, and when the reader
    goes away (the generator is closed or its task cancelled: the finally)."""
    sent = 0
    echo = run.echo is not None
    try:
        async for tok in _tokens(run.req):
            if echo:
                yield run.echoed()
                echo = False
            text = run.text.push(tok)
            if text or run.text.tokenizer is None:
                end = len(run.text.tokens)
                yield run.piece(text, sent, end)
                sent = end
            if run.text.finished:
                break
        if echo:
            yield run.echoed()
        text = run.text.flush()
        end = len(run.text.tokens)
        if text or sent < end:
            yield run.piece(text, sent, end)
    finally:
        run.req.cancel()
    metrics.observe(run.req)


async def _collect(runs, request: Request, metrics: Metrics) -> None:
    """Run every request to its end; cancel them all if the client disconnects first."""
    async def drain(run):
        async for _ in _pieces(run, metrics):
            pass

    work = asyncio.ensure_future(asyncio.gather(*(drain(r) for r in runs)))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            for r in runs:
                r.req.cancel()
    if work.cancelled():
        raise APIError(499, "the client closed the request", code="client_closed")
    try:
        work.result()
    except EngineClosed as e:
        raise APIError(503, e.message, type="server_error", code="engine_stopped") from None
    except TercompError as e:
        raise APIError(500, f"generation failed: {e.message}", type="server_error") from None


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (its body was read: the next ASGI message
    is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _sse(runs, request, metrics, head, choice, include_usage, first=None) -> StreamingResponse:
    """Server-sent events of every run's pieces, merged as they come: one chunk per
    piece, a last chunk per choice with its finish_reason, a usage chunk when asked,
    then `data: [DONE]`. A client that goes away cancels the task reading the runs
    (Starlette's disconnect listener), whose cleanup cancels the requests."""
    def event(choices, **extra) -> str:
        return f"data: {json.dumps({**head, 'choices': choices, **extra})}\n\n"

    async def events():
        queue: asyncio.Queue = asyncio.Queue()

        async def drain(i, run):
            try:
                async for piece in _pieces(run, metrics):
                    await queue.put((i, piece))
                await queue.put((i, None))
            except BaseException as e:
                await queue.put((i, e))

        tasks = [asyncio.ensure_future(drain(i, r)) for i, r in enumerate(runs)]
        try:
            for f in first or ():
                yield event([f])
            left = len(runs)
            while left:
                i, piece = await queue.get()
                if isinstance(piece, BaseException):
                    message = getattr(piece, "message", None) or str(piece)
                    yield f"data: {json.dumps(error_body(f'generation failed: {message}', 'server_error'))}\n\n"
                    left -= 1
                elif piece is None:
                    yield event([choice(i, runs[i], _Piece("", [], [], []), runs[i].finish_reason)])
                    left -= 1
                else:
                    yield event([choice(i, runs[i], piece, None)])
            if include_usage:
                yield event([], usage=_usage(runs))
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            for r in runs:
                r.req.cancel()

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# -- errors, keys and body size ----------------------------------------------------------------

def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return JSONResponse(e.body, status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        err = (e.errors() or [{}])[0]
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            return JSONResponse(error_body("the request body is not valid JSON: "
                                           f"{err.get('ctx', {}).get('error', '')}".rstrip(": "),
                                           code="invalid_json"), status_code=400)
        param = loc[0] if loc else None
        message = err.get("msg", "invalid request").removeprefix("Value error, ")
        if not loc and err.get("type") in ("model_attributes_type", "dict_type"):
            message = "the request body must be a JSON object (Content-Type: application/json)"
        elif param == "prompt" and err.get("type") != "value_error":
            message = "prompt must be a string, a list of token ids (ints), or a list of either"
        elif loc:
            message = f"{'.'.join(loc)}: {message}"
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        return JSONResponse(error_body(str(e.detail), code=str(e.status_code)),
                            status_code=e.status_code)



#: the paths that need the API key (/health and /metrics stay open)
_KEYED = ("/v1/", "/tokenize", "/detokenize", "/tokenizer_info")


class _Guard:
    """ASGI middleware in front of the app: the API key of keyed paths (before the body
    is read), the body size limit and read timeout (408), a body that is not UTF-8 or
    holds a lone surrogate (400: nothing downstream could encode it), any exception as
    a JSON 500 that keeps the connection open (Starlette's error middleware re-raises
    after its 500, and uvicorn then drops the connection), and the error count of
    /metrics."""

    def __init__(self, app, api_key, max_body, metrics, read_timeout):
        self.app, self.max_body, self.metrics = app, int(max_body), metrics
        self.key = api_key.encode() if api_key else None
        self.read_timeout = read_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def counted(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if message["status"] >= 400:
                    self.metrics.errors.labels(str(message["status"])).inc()
            await send(message)

        try:
            await self._guarded(scope, receive, counted)
        except Exception as e:                          # a bug: still a JSON answer
            if started:
                raise
            await _answer(counted, 500, error_body(f"internal error: {type(e).__name__}",
                                                   type="server_error"))

    async def _guarded(self, scope, receive, send):
        headers = dict(scope.get("headers") or ())
        if self.key is not None and scope["path"].startswith(_KEYED) \
                and not self._authorized(headers.get(b"authorization", b"")):
            return await _answer(send, 401, error_body(
                "Incorrect or missing API key: pass `Authorization: Bearer <key>`",
                code="invalid_api_key"))
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return await _answer(send, 413, self._too_large())
        body, more = [], True
        size = 0
        deadline = time.monotonic() + self.read_timeout       # for the whole body
        while more:
            try:
                message = await asyncio.wait_for(receive(), deadline - time.monotonic())
            except asyncio.TimeoutError:
                return await _answer(send, 408, error_body(
                    f"the request body did not arrive within {self.read_timeout:g} s",
                    code="request_timeout"), close=True)
            if message["type"] != "http.request":
                return                                 # the client went away
            body.append(message.get("body", b""))
            size += len(body[-1])
            more = message.get("more_body", False)
            if size > self.max_body:
                return await _answer(send, 413, self._too_large())
        data = b"".join(body)
        bad = _unencodable(data)
        if bad is not None:
            return await _answer(send, 400, error_body(bad[0], param=bad[1],
                                                       code="invalid_encoding"))
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": data, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _authorized(self, header: bytes) -> bool:
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    def _too_large(self) -> dict:
        return error_body(f"the request body is over {self.max_body} bytes",
                          code="request_too_large")


def _unencodable(data: bytes):
    """(message, field) when a body is not UTF-8 or a JSON string in it holds a lone
    surrogate (`"\\ud800"`: valid JSON, not encodable text), else None."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"the request body is not valid UTF-8 (byte {e.start})", None
    if not _SURROGATE.search(data):
        return None
    try:
        value = json.loads(data)
    except ValueError:
        return None                     # the app answers invalid JSON
    stack = [(value, None)]
    while stack:
        v, field = stack.pop()
        if isinstance(v, dict):
            stack.extend((x, field or k) for k, x in v.items())
            stack.extend((k, field or k) for k in v)
        elif isinstance(v, list):
            stack.extend((x, field) for x in v)
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                where = f"`{field}`" if isinstance(field, str) and field.isascii() else "a key"
                return (f"{where} holds a lone UTF-16 surrogate (\\ud800-\\udfff without its "
                        f"pair): not text", field if where != "a key" else None)
    return None


#: a JSON escape of a UTF-16 surrogate
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


async def _answer(send, status: int, body: dict, close: bool = False) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status,
                "headers": headers + ([(b"connection", b"close")] if close else [])})
    await send({"type": "http.response.body", "body": data})
