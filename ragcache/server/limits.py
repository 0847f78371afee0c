"""The size limits of a request to ``ragcache serve``: its head (request line and headers) and its body.

Owns: :class:`HeadLimitedH11Protocol` (uvicorn's h11 protocol with ``serve.max_header_bytes`` on
the whole head of every request, answered 431) and :class:`BodyLimit` (ASGI middleware with
``serve.max_body_bytes`` on the body, answered 413 before the body is parsed). Both answer in
OpenAI's error shape. Imports uvicorn, h11 and ragcache.server.schemas; no engine, no FastAPI.

Why a protocol and not only h11's own limit: h11's ``max_incomplete_event_size`` bounds the bytes it
buffers while a head is incomplete, so a head that arrives in one read of the socket (a 70 KB
header, a 70 KB URL, 1000 headers of 100 bytes) passes whatever its size. Here every parsed head is
measured as well, so the limit holds however the bytes arrive; h11's bound still keeps an
unfinished head from growing past the limit in memory.

After a refusal the connection is closed gracefully: the answer is sent, the server's side is shut
for writing, and whatever the client still sends is read and dropped for up to
:data:`LINGER_S` seconds (closing at once with unread bytes would reset the connection, and the
client could lose the answer before reading it).
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import Any, Awaitable, Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ragcache.server.schemas import APIError

log = logging.getLogger(__name__)

#: seconds a refused connection keeps reading (and dropping) what its client still sends
LINGER_S = 2.0

ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


def head_bytes(request: h11.Request) -> int:
    """Bytes of ``request``'s head on the wire: request line, headers (``name: value`` and CRLF
    each) and the blank line that ends them. Whitespace around a header value, which h11 strips,
    is not counted."""
    line = len(request.method) + 1 + len(request.target) + len(b" HTTP/") + len(request.http_version) + 2
    return line + sum(len(name) + 2 + len(value) + 2 for name, value in request.headers.raw_items()) + 2


def head_too_large(limit: int) -> APIError:
    """The 431 error for a request head over ``limit`` bytes (``serve.max_header_bytes``)."""
    return APIError(431, f"the request line and headers take more than serve.max_header_bytes = {limit} bytes; "
                    "send a shorter URL or fewer and shorter headers (or ask the server's operator to raise "
                    "serve.max_header_bytes)", code="request_header_fields_too_large")


class _HeadLimitedConnection(h11.Connection):
    """h11's server side with ``limit`` bytes on every request's head, complete or not.

    Attributes:
        head_refused: the last :class:`h11.RemoteProtocolError` was a head over the limit.
    """

    def __init__(self, limit: int):
        super().__init__(h11.SERVER, max_incomplete_event_size=limit)
        self.limit = limit
        self.head_refused = False

    def next_event(self) -> Any:
        """h11's next event; a head over the limit raises instead of becoming a request.

        Raises:
            h11.RemoteProtocolError: a malformed request, or (``error_status_hint`` 431 and
                ``head_refused`` set) a head of more than ``limit`` bytes.
        """
        awaiting_head = self.their_state is h11.IDLE
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as exc:
            self.head_refused = awaiting_head and exc.error_status_hint == 431  # h11's buffer bound
            raise
        if isinstance(event, h11.Request) and head_bytes(event) > self.limit:
            self.head_refused = True
            raise h11.RemoteProtocolError("request head too large", error_status_hint=431)
        return event


class HeadLimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with ``config.h11_max_incomplete_event_size`` (``serve.max_header_bytes``)
    as the limit on every request's head, answered 431 in OpenAI's error shape; other malformed
    requests get uvicorn's own 400. Pass the class as ``uvicorn.Config(http=...)``."""

    def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any], _loop: Any = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.conn = _HeadLimitedConnection(config.h11_max_incomplete_event_size)
        self._refused = False

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # the rest of a refused request: dropped while the connection lingers
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        if not self.conn.head_refused:
            super().send_400_response(msg)
            return
        err = head_too_large(self.conn.limit)
        body = json.dumps(err.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        start = h11.Response(status_code=err.status, headers=headers, reason=HTTPStatus(err.status).phrase.encode())
        for event in (start, h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        log.info("refused a request from %s: its head is over serve.max_header_bytes = %d bytes",
                 self.client[0] if self.client else "?", self.conn.limit)
        self._refused = True
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the answer, then end of stream; keep reading until the client closes
        self.loop.call_later(LINGER_S, self.transport.close)


def body_too_large(limit: int, seen: str) -> APIError:
    """The 413 error for a body over ``limit`` bytes (``serve.max_body_bytes``); ``seen``: what
    showed it (``"Content-Length 62914560"``, ``"more than 8388608 bytes arrived"``)."""
    return APIError(413, f"the request body is larger than serve.max_body_bytes = {limit} bytes ({seen}); send "
                    "a shorter conversation (or ask the server's operator to raise serve.max_body_bytes)",
                    code="request_too_large")


class BodyLimit:
    """ASGI middleware: a request whose body is over ``limit()`` bytes is answered 413 before any
    of it is parsed: at once when its ``Content-Length`` says so, else (a chunked body) as soon as
    more than the limit has arrived. The body is read here, at most ``limit()`` bytes of it, and
    handed to the app whole; a client that disconnects before its body is complete gets nothing
    and costs nothing more.

    Args:
        app: the ASGI app.
        limit: the limit in bytes, read per request (``serve.max_body_bytes``).
    """

    def __init__(self, app: ASGIApp, limit: Callable[[], int]):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]],
                       send: Callable[[dict], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit()
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _answer(send, body_too_large(limit, f"Content-Length {int(length)}"))
            return
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before its body was complete: nobody to answer
            body += message.get("body", b"")
            if len(body) > limit:
                await _answer(send, body_too_large(limit, f"more than {limit} bytes arrived"))
                return
            more = message.get("more_body", False)
        whole: dict | None = {"type": "http.request", "body": bytes(body), "more_body": False}
        del body

        async def replay() -> dict:
            nonlocal whole
            if whole is not None:
                message, whole = whole, None
                return message
            return await receive()  # after the body: http.disconnect when the client goes

        await self.app(scope, replay, send)


async def _answer(send: Callable[[dict], Awaitable[None]], err: APIError) -> None:
    body = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
