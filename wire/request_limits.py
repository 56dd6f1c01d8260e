"""Caps on a request's headers and body, the same rule and the same answers at every service: 431
for headers larger than `max_header_bytes` in all (names and values), 413 for a body larger than
`max_body_bytes`, both in the OpenAI error shape, before routing and before any token is checked.

Without them, anyone who can reach a port makes the server hold a body of any size (or a
megabyte of headers) in memory before it is told 401. `RequestLimits` is the ASGI middleware of
the node agent and the control plane: a body over the cap is refused at once when its
Content-Length says so, else as soon as what has arrived passes the cap; the body is never read
further. A body within its Content-Length is left to the app to read (a token check inside
refuses it unread); a chunked one is read here (at most the cap per request) and handed on
unchanged. The gateway applies the same rule in aiohttp (gateway/http_limits.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from wire.errors import error_json

_JSON: Final = (b"content-type", b"application/json")


class BodyTooLargeError(Exception):
    pass


def header_bytes(headers: Iterable[tuple[bytes, bytes]]) -> int:
    """What the cap counts: every header's name and value."""
    return sum(len(name) + len(value) for name, value in headers)


def headers_too_large(max_header_bytes: int) -> str:
    return f"request headers are larger than {max_header_bytes} bytes"


def body_too_large(max_body_bytes: int) -> str:
    return f"request body is larger than {max_body_bytes} bytes"


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            # The server has validated it; a bad one never reaches an app.
            return int(value)
    return None


def _is_chunked(scope: Scope) -> bool:
    return any(name == b"transfer-encoding" for name, _ in scope["headers"])


def _has_body(scope: Scope) -> bool:
    return any(name in (b"content-length", b"transfer-encoding") for name, _ in scope["headers"])


async def _send_error(send: Send, status: int, message: str) -> None:
    body = error_json(status, message)
    headers = [_JSON, (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequestLimits:
    def __init__(self, app: ASGIApp, max_body_bytes: int, max_header_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if header_bytes(scope["headers"]) > self.max_header_bytes:
            await _send_error(send, 431, headers_too_large(self.max_header_bytes))
            return
        if not _has_body(scope):
            await self.app(scope, receive, send)
            return
        too_large = body_too_large(self.max_body_bytes)
        length = _content_length(scope)
        if length is not None and length > self.max_body_bytes:
            await _send_error(send, 413, too_large)
            return
        if length is not None and not _is_chunked(scope):
            # The server hands on no more than the length says: nothing to read ahead, and a
            # handler that refuses (a missing token) reads none of it.
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read(receive)
        except BodyTooLargeError:
            await _send_error(send, 413, too_large)
            return
        await self.app(scope, replay_first(body, receive), send)

    async def _read(self, receive: Receive) -> Message:
        """The whole body as one message (or the disconnect that cut it short)."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return message
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise BodyTooLargeError
            chunks.append(chunk)
            if not message.get("more_body", False):
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}


def replay_first(first: Message, receive: Receive) -> Receive:
    """A `receive` that hands out `first` (a message already read), then reads on."""
    is_replayed = False

    async def replay() -> Message:
        nonlocal is_replayed
        if is_replayed:
            return await receive()
        is_replayed = True
        return first

    return replay
