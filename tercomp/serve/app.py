"""The OpenAI-compatible HTTP API over an Engine (runtime.scheduler): a FastAPI app.

    GET  /v1/models                the one model served
    POST /v1/completions           prompt: text, token ids, or a list of either
    POST /v1/chat/completions      messages rendered by the model's chat template
    POST /v1/embeddings            pooled hidden states (with an encoder: `embedder`)
    POST /tokenize, /detokenize    llama-server's and vLLM's: text to ids and back
    GET  /tokenizer_info           vLLM's: special tokens and the chat template
    GET  /health                   200 while the engine runs, else 503
    GET  /metrics                  Prometheus text (serve.metrics)

Sampling (n, best_of, penalties, logit_bias, min_p), log-probabilities and structured
output (serve.structured: also what forces a tool call, serve.tools) are per request in
the engine; text is text
(runtime.chat.TextEncoder: special tokens only from the chat template, or where
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
import json
import secrets
import threading
import time
import uuid
from typing import NamedTuple

import anyio
import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..errors import InputError, TercompError
from ..runtime.scheduler import EngineClosed, QueueFull
from .guard import APIError, Guard, add_error_handlers
from .metrics import CONTENT_TYPE, Metrics
from .model import ServedEncoder, ServedModel, encode_embedding
from .protocol import (COMPLETION_MAX_TOKENS, MAX_PROMPTS, ChatRequest, CompletionRequest,
                       DetokenizeRequest, EmbeddingRequest, TokenizeRequest, error_body)
from .structured import GrammarError
from .text import TextStream
from .tools import ToolParser, call_grammar, openai_call, split

#: the largest request body accepted, in bytes (create_app's max_body)
MAX_BODY = 1 << 20
#: seconds a request body may take to arrive (a 408 after)
READ_TIMEOUT = 10.0
#: the most tokens one request may generate over all its prompts and choices
MAX_REQUEST_TOKENS = 1 << 15
#: prompts tokenized at once (the others wait, off the event loop)
TOKENIZING = 4

_END = object()


def create_app(engine, model_name: str, api_key: str | None = None,
               max_body: int = MAX_BODY, read_timeout: float = READ_TIMEOUT,
               max_request_tokens: int = MAX_REQUEST_TOKENS, embedder=None,
               tool_call_parser: str | None = None, chat_template: str | None = None,
               template_origin: str = "--chat-template") -> FastAPI:
    """The FastAPI app serving `engine` (a runtime.Engine) as `model_name`. With
    `api_key`, every /v1 request needs `Authorization: Bearer <api_key>` (/health and
    /metrics stay open, for load balancers and scrapers). A body must arrive within
    `read_timeout` seconds; one request may generate (or embed) `max_request_tokens`
    tokens over all its prompts and choices. `embedder` (tc.compile_embed's, of the
    same model) answers /v1/embeddings; without one that endpoint is a 400 saying how
    to get one. `tool_call_parser` ("hermes", "llama3_json" or "mistral", vLLM's
    names) parses and forces tool calls in that syntax whatever the chat template asks
    for (None: the template's, serve.tools.template_syntax). `chat_template` (a Jinja
    template's text, from `template_origin`) replaces the model's. The caller owns the
    engine (closes it after the server stops)."""
    model = ServedModel(engine.model, tool_call_parser, chat_template, template_origin)
    encoder = None if embedder is None else ServedEncoder(embedder, model, max_request_tokens)
    tokenizing = anyio.CapacityLimiter(TOKENIZING)
    encoding = anyio.CapacityLimiter(1)     # one batched encoder call at a time

    async def off_loop(fn, *args):
        """Tokenization off the event loop, a few at a time (the rest wait their turn
        without holding threads the other endpoints need)."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=tokenizing)
    metrics = Metrics(engine)
    created = int(time.time())
    app = FastAPI(title="tercomp", summary=f"OpenAI-compatible API serving {model_name}")
    app.state.engine, app.state.metrics = engine, metrics
    app.add_middleware(Guard, api_key=api_key, max_body=max_body, metrics=metrics,
                       read_timeout=read_timeout)
    add_error_handlers(app)

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
        # null is OpenAI's default (chat's null is "to the context")
        max_tokens = _budget(COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens,
                             len(texts) * body.candidates, model.max_seq, max_request_tokens)
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
        mode = body.tool_mode()
        offered = body.tools if mode else None
        prompt = await off_loop(model.render_chat, body.messages, bool(body.parse_special),
                                offered)
        limit = _budget(body.max_completion_tokens or body.max_tokens, body.choices,
                        model.max_seq, max_request_tokens, "max_completion_tokens"
                        if body.max_completion_tokens else "max_tokens")
        top = (body.top_logprobs or 0) if body.logprobs else None
        grammar = await _grammar(model, body, off_loop, mode)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        tags = model.tool_tags() if mode else {}
        runs = _submit(engine, model, body, [prompt], [limit], "messages", logprobs=top,
                       candidates=body.choices, group=rid, grammar=grammar,
                       keep={i: tag for tag, i in tags.items()})
        head = {"id": rid, "object": "chat.completion",
                "created": int(time.time()), "model": model_name}
        names = {t.function.name for t in offered or ()}
        parallel = body.parallel_tool_calls is not False

        def logprobs(piece):
            return None if top is None else \
                {"content": model.chat_logprobs(piece.logged, piece.scores)}

        if body.stream:
            parsers = [ToolParser(names, parallel, model.tool_syntax) for _ in runs] \
                if mode else None
            sent = [0] * len(runs)

            def delta(i, run, piece, finish):
                if parsers is None:
                    d = {} if finish else {"content": piece.text}
                    return {"index": i, "delta": d, "logprobs": None if finish else logprobs(piece),
                            "finish_reason": finish}
                # with tools: content and whole calls as the parser finds them
                out = []
                for kind, v in parsers[i].flush() if finish else parsers[i].push(piece.text):
                    if kind == "content":
                        d = {"content": v}
                    else:
                        d = {"tool_calls": [{"index": sent[i], **openai_call(*v)}]}
                        sent[i] += 1
                    out.append({"index": i, "delta": d, "logprobs": None, "finish_reason": None})
                lp = None if finish else logprobs(piece)
                if lp is not None:          # held text's log-probabilities come now
                    if not out:
                        out.append({"index": i, "delta": {}, "logprobs": None,
                                    "finish_reason": None})
                    out[0]["logprobs"] = lp
                if finish:
                    out.append({"index": i, "delta": {}, "logprobs": None, "finish_reason":
                                "tool_calls" if sent[i] and finish == "stop" else finish})
                return out
            first = [{"index": i, "delta": {"role": "assistant", "content": ""},
                      "logprobs": None, "finish_reason": None} for i in range(len(runs))]
            return _sse(runs, request, metrics, {**head, "object": "chat.completion.chunk"},
                        delta, _include_usage(body), first=first)
        await _collect(runs, request, metrics)

        def message(i, r):
            whole, finish = r.whole(), r.finish_reason
            msg = {"role": "assistant", "content": whole.text}
            if mode:
                msg["content"], calls = split(whole.text, names, parallel, model.tool_syntax)
                if calls:
                    msg["tool_calls"] = [openai_call(*c) for c in calls]
                    finish = "tool_calls" if finish == "stop" else finish
            return {"index": i, "logprobs": logprobs(whole), "finish_reason": finish,
                    "message": msg}
        return {**head, "choices": [message(i, r) for i, r in enumerate(runs)],
                "usage": _usage(runs)}

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest):
        """OpenAI's embeddings: one pooled (and normalised) vector per input, computed
        in one batched encoder call off the event loop."""
        check_model(body.model)
        if encoder is None:
            raise APIError(400, "this server has no embedding encoder (a saved .tcm holds "
                                "none): serve the model file (.gguf or Hugging Face "
                                "directory) with --embeddings, as in `tercomp serve "
                                "MODEL.gguf --embeddings`", param="model",
                           code="embeddings_not_enabled")
        if body.dimensions is not None and body.dimensions > encoder.hidden_size:
            raise APIError(400, f"dimensions must be from 1 to the model's {encoder.hidden_size}, "
                                f"got {body.dimensions}", param="dimensions")
        seqs = await off_loop(encoder.sequences, body.input)
        try:
            out = await anyio.to_thread.run_sync(encoder.embed, seqs, body.dimensions,
                                                 limiter=encoding)
        except TercompError as e:
            raise APIError(500, f"embedding failed: {e.message}", type="server_error") from None
        fmt = body.encoding_format or "float"
        tokens = sum(map(len, seqs))
        return {"object": "list", "model": model_name,
                "data": [{"object": "embedding", "index": i,
                          "embedding": encode_embedding(row, fmt)} for i, row in enumerate(out)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

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



def _submit(engine, model: ServedModel, body, prompts, limits, param, logprobs=None,
            echo=None, candidates: int = 1, group=None, grammar=None, keep=None) -> list:
    """Submit `candidates` requests per prompt (all or none: a refused one cancels the
    others), the j-th of a prompt seeded with seed + j. `logprobs`: the alternatives per
    generated token (None: no log-probabilities); `echo`: per prompt, (text, ids) to
    echo (the prompt scored too when `logprobs`); `keep` ({id: text}): special tokens
    whose text the answer keeps (text.TextStream)."""
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
                runs.append(_Run(req, TextStream(model.tokenizer, body.stop or (), stop_ids,
                                                 keep),
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


async def _grammar(model: ServedModel, body, off_loop, tool_mode=None):
    """The compiled output constraint of a request (None without one), off the event
    loop (a large schema takes a while); a 400 naming the field when it cannot be
    enforced. `tool_mode` "required" or a function's name (chat's tool_choice): the
    grammar of such a call (serve.tools), alone."""
    try:
        spec = body.constraint()
    except ValueError as e:
        raise APIError(400, str(e), param=str(e).split(":")[0]) from None
    if tool_mode not in (None, "auto"):
        if spec is not None:
            raise APIError(400, f"tool_choice {tool_mode!r} forces a tool call, so {spec[0]} "
                                f"cannot constrain the output too", param="tool_choice")
        spec = ("tools", "lark", call_grammar(body.tools, None if tool_mode == "required"
                                              else tool_mode, body.parallel_tool_calls
                                              is not False, model.tool_syntax,
                                              model.tool_tags()))
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
    first = {r.prompt_index: r for r in runs}.values()
    prompt = sum(int(r.req.prompt.size) for r in first)
    completion = sum(len(r.text.tokens) for r in runs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            # OpenAI's field for the prompt tokens its prompt cache served
            "prompt_tokens_details": {"cached_tokens": sum(r.req.cached_tokens for r in first)}}


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
    """The _Pieces of one run as they can be sent, the echoed prompt first (once it is
    prefilled: with the first token, or at the end); the request is cancelled when a stop string ends it, and when the reader
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


def _listed(c) -> list:
    return c if isinstance(c, list) else [c]


def _sse(runs, request, metrics, head, choice, include_usage, first=None) -> StreamingResponse:
    """Server-sent events of every run's pieces, merged as they come: a chunk per piece
    (`choice` gives one, or a list of them: none while text is held), a last chunk per
    choice with its finish_reason, a usage chunk when asked,
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
                    for c in _listed(choice(i, runs[i], _Piece("", [], [], []),
                                            runs[i].finish_reason)):
                        yield event([c])
                    left -= 1
                else:
                    for c in _listed(choice(i, runs[i], piece, None)):
                        yield event([c])
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
