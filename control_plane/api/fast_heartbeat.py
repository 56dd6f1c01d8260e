"""The heartbeat's fast path: `POST /v1/nodes/heartbeat` from a known node, without FastAPI.

At 1,000 heartbeats a second, FastAPI's per-request work (routing through every route, solving the
dependency tree, validating the reply against its model) cost three times what the heartbeat
itself does. This ASGI wrapper answers the common case directly: the node token, a JSON body that
validates as a `Heartbeat`, from a node already registered with the same identity, with that
node's own credential. Everything else (a first beat, a bad token, a credential of another node,
a bad body) goes on to the FastAPI route, with the body replayed, so
errors, registration and the OpenAPI schema stay where they are and behave the same.
"""

from __future__ import annotations

import logging
from typing import Final

from pydantic import ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from control_plane.api.auth import MAX_AGENT_LEN
from control_plane.api.nodes import heartbeat_reply
from control_plane.audit import Actor
from control_plane.model import NodeIdentity
from control_plane.services import ControlPlane
from control_plane.tokens import TokenKind
from wire.heartbeat import Heartbeat
from wire.request_limits import replay_first

logger = logging.getLogger(__name__)

PATH: Final = "/v1/nodes/heartbeat"
MAX_BODY_BYTES: Final = 64 * 1024  # a heartbeat is well under 1 KiB; bigger ones take the slow path
_JSON_HEADERS: Final = [(b"content-type", b"application/json")]


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


def _actor(scope: Scope) -> Actor:
    client = scope.get("client")
    address = f"{client[0]}:{client[1]}" if client else "unknown"
    agent = (_header(scope, b"user-agent") or b"").decode("latin-1")[:MAX_AGENT_LEN]
    return Actor(kind=TokenKind.NODE.value, client=f"{address} ({agent})" if agent else address)


class HeartbeatFastPath:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != PATH or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        body, is_complete = await self._read(receive)
        if not is_complete or not await self._answer(scope, body, send):
            first = {"type": "http.request", "body": body, "more_body": not is_complete}
            await self.app(scope, replay_first(first, receive), send)

    @staticmethod
    async def _read(receive: Receive) -> tuple[bytes, bool]:
        """The request body, unless it is larger than MAX_BODY_BYTES (then what was read)."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks), False
            chunk = message.get("body", b"")
            chunks.append(chunk)
            size += len(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), True
            if size > MAX_BODY_BYTES:
                return b"".join(chunks), False

    async def _answer(self, scope: Scope, body: bytes, send: Send) -> bool:
        """Answer a well-formed beat from a known node; False to leave it to the FastAPI route."""
        app = scope.get("app")
        services = getattr(getattr(app, "state", None), "services", None)
        if not isinstance(services, ControlPlane):
            return False
        authorization = _header(scope, b"authorization") or b""
        scheme, _, token = authorization.decode("latin-1").partition(" ")
        credential = services.credentials.find(token)
        if scheme.lower() != "bearer" or credential is None:
            return False
        content_type = (_header(scope, b"content-type") or b"").split(b";")[0].strip().lower()
        if content_type != b"application/json":
            return False
        try:
            beat = Heartbeat.model_validate_json(body)
        except ValidationError:
            return False
        if credential.refusal(beat) is not None:
            return False  # the FastAPI route answers 403 with the reason
        node = services.fleet.nodes.get(beat.node_id)
        if node is None or not node.is_from_heartbeats or node.identity != NodeIdentity.of(beat):
            return False  # registration writes to the store: the FastAPI route does it
        node = await services.registry.record_heartbeat(_actor(scope), beat)
        reply = heartbeat_reply(services, node, beat).model_dump_json().encode()
        headers = [*_JSON_HEADERS, (b"content-length", str(len(reply)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": reply})
        return True
