"""The HTTP server under the app: uvicorn, with what a server facing hostile clients
needs and uvicorn does not give.

- `timeout_keep_alive` (uvicorn's own): an idle keep-alive connection is closed.
- A request head must arrive within `read_timeout` seconds (uvicorn has no header
  timeout: a client sending one byte a second holds its connection for as long as it
  likes). The body's timeout is the app's (guard.Guard), which answers 408.
- A request h11 cannot parse is answered a 400 with OpenAI's JSON error body, as every
  other error (uvicorn's is plain text).
- At most `max_connections` open connections: the next one is answered a 503 with
  OpenAI's JSON error body and closed (uvicorn's `limit_concurrency` answers plain
  text, and counts requests, not idle connections).
- SIGTERM / SIGINT: the engine stops taking requests (a 503 JSON for each new one),
  uvicorn stops accepting connections, the running requests have `drain` seconds to
  finish; then the engine closes and every request still open ends with OpenAI's
  error body (a 503, or an error event and `data: [DONE]` in a stream).

    >>> serve(app, engine, host="127.0.0.1", port=8000)
"""
from __future__ import annotations

import json
import threading

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .protocol import error_body

#: seconds a request head may take to arrive
READ_TIMEOUT = 10.0
#: open connections at most
MAX_CONNECTIONS = 512
#: seconds an idle keep-alive connection stays open
KEEP_ALIVE = 5
#: seconds the running requests have to finish on SIGTERM
DRAIN = 10.0


def _raw_json(status: int, reason: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\nconnection: close\r\n\r\n").encode() + data


def protocol(read_timeout: float = READ_TIMEOUT, max_connections: int = MAX_CONNECTIONS):
    """uvicorn's h11 protocol class with a request-head timeout and a connection cap."""

    class Protocol(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._head_timer = None
            if len(self.connections) > max_connections:
                transport.write(_raw_json(503, "Service Unavailable", error_body(
                    f"the server has {max_connections} open connections: retry later",
                    "server_error", code="too_many_connections")))
                transport.close()
                return
            self._arm()

        def _waiting_for_head(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self):
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(read_timeout, self._head_timeout)

        def _disarm(self):
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self):
            self._head_timer = None
            if self._waiting_for_head() and not self.transport.is_closing():
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._waiting_for_head():
                self._arm()             # a head has begun (or the keep-alive wait ended)
            else:
                self._disarm()

        def send_400_response(self, msg: str) -> None:
            # a request h11 cannot parse: OpenAI's JSON error body, not uvicorn's text
            data = json.dumps(error_body(msg, code="invalid_http")).encode()
            headers = [(b"content-type", b"application/json"),
                       (b"content-length", str(len(data)).encode()), (b"connection", b"close")]
            try:
                for event in (h11.Response(status_code=400, headers=headers,
                                           reason=b"Bad Request"),
                              h11.Data(data=data), h11.EndOfMessage()):
                    self.transport.write(self.conn.send(event))
            except h11.LocalProtocolError:
                pass                    # nothing more can be sent on this connection
            self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._disarm()              # keep-alive's timer watches the idle connection

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return Protocol


class _Server(uvicorn.Server):
    """uvicorn's server that drains the engine on the first exit signal."""

    def __init__(self, config, engine, drain: float):
        super().__init__(config)
        self.engine, self.drain = engine, drain

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            self.engine.drain("the server is shutting down")
            timer = threading.Timer(self.drain, self.engine.close,
                                    kwargs={"reason": "the server shut down before the "
                                                      "request finished"})
            timer.daemon = True
            timer.start()
        super().handle_exit(sig, frame)


def serve(app, engine, host: str = "127.0.0.1", port: int = 8000,
          read_timeout: float = READ_TIMEOUT, max_connections: int = MAX_CONNECTIONS,
          keep_alive: int = KEEP_ALIVE, drain: float = DRAIN, log_level: str = "warning"):
    """Run `app` (serving `engine`) until SIGTERM or SIGINT; returns after the drain."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            http=protocol(read_timeout, max_connections),
                            timeout_keep_alive=keep_alive,
                            timeout_graceful_shutdown=drain + 5)
    _Server(config, engine, drain).run()
