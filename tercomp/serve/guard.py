"""The HTTP edge of the app: OpenAI's error bodies for every error (APIError, the
validation and routing errors, any exception), and the ASGI middleware in front of
every request: the API key, the body's size, read deadline and encoding.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import re
import time

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .protocol import error_body


class APIError(Exception):
    """An error answered as OpenAI's JSON error body with `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param=None, code=None):
        super().__init__(message)
        self.status, self.body = status, error_body(message, type, param, code)


def add_error_handlers(app: FastAPI) -> None:
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
        elif param == "input" and err.get("type") != "value_error":
            message = ("input must be a string, a list of strings, a list of token ids "
                       "(ints), or a list of token-id lists")
        elif loc:
            message = f"{'.'.join(loc)}: {message}"
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        return JSONResponse(error_body(str(e.detail), code=str(e.status_code)),
                            status_code=e.status_code)



#: the paths that need the API key (/health and /metrics stay open)
KEYED = ("/v1/", "/tokenize", "/detokenize", "/tokenizer_info")


class Guard:
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
            await answer(counted, 500, error_body(f"internal error: {type(e).__name__}",
                                                   type="server_error"))

    async def _guarded(self, scope, receive, send):
        headers = dict(scope.get("headers") or ())
        if self.key is not None and scope["path"].startswith(KEYED) \
                and not self._authorized(headers.get(b"authorization", b"")):
            return await answer(send, 401, error_body(
                "Incorrect or missing API key: pass `Authorization: Bearer <key>`",
                code="invalid_api_key"))
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return await answer(send, 413, self._too_large())
        body, more = [], True
        size = 0
        deadline = time.monotonic() + self.read_timeout       # for the whole body
        while more:
            try:
                message = await asyncio.wait_for(receive(), deadline - time.monotonic())
            except asyncio.TimeoutError:
                return await answer(send, 408, error_body(
                    f"the request body did not arrive within {self.read_timeout:g} s",
                    code="request_timeout"), close=True)
            if message["type"] != "http.request":
                return                                 # the client went away
            body.append(message.get("body", b""))
            size += len(body[-1])
            more = message.get("more_body", False)
            if size > self.max_body:
                return await answer(send, 413, self._too_large())
        data = b"".join(body)
        bad = _unencodable(data)
        if bad is not None:
            return await answer(send, 400, error_body(bad[0], param=bad[1],
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


async def answer(send, status: int, body: dict, close: bool = False) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status,
                "headers": headers + ([(b"connection", b"close")] if close else [])})
    await send({"type": "http.response.body", "body": data})
