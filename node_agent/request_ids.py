"""Request ids: take the caller's `X-Request-Id` (the gateway sends one) if it is safe
(wire/request_ids.py) or make one; echo it, beside the node's own id (`X-Meridian-Node`: a
gateway matches a stream's node against the region summary's unhealthy nodes).

A pure ASGI middleware, so that streaming bodies and disconnect detection pass through untouched.
The id is in `request.state.request_id` for handlers and logs.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from wire.heartbeat import NODE_ID_HEADER
from wire.request_ids import HEADER, request_id_from


def request_id_of(scope: Scope) -> str:
    state = scope.get("state") or {}
    return str(state.get("request_id", ""))


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp, node_id: str):
        self.app = app
        self._node_header = (NODE_ID_HEADER.encode(), node_id.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = None
        for name, value in scope["headers"]:
            if name == HEADER.encode():
                given = value.decode("latin-1")
                break
        request_id = request_id_from(given)
        scope.setdefault("state", {})["request_id"] = request_id
        header = (HEADER.encode(), request_id.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), header, self._node_header]
            await send(message)

        await self.app(scope, receive, send_with_id)
