"""The serving token: with one configured, every `/v1` route answers only `Authorization: Bearer
<token>` (the gateway sends it upstream); `/health`, `/ready` and `/metrics` stay open for probes
and scrapers.

A pure ASGI middleware, so that a caller without the token is refused before its body is read
or parsed, and so that unknown `/v1` paths are guarded as well as the routes.

The serving token is the node's only credential, and only gateways hold it: a request that
presented it is a gateway's (`is_gateway`), and may use the gateway's own fields
(`resume_token_ids`, wire/resume.py). A node without a token serves every caller on loopback
alike, and so none of them as a gateway.
"""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from wire.errors import INVALID_CREDENTIAL, MISSING_CREDENTIAL, error_body

_GUARDED_PREFIX = "/v1"
_SCHEME = b"bearer "
_GATEWAY_SCOPE_KEY = "meridian.gateway"


def is_guarded(path: str) -> bool:
    return path == _GUARDED_PREFIX or path.startswith(_GUARDED_PREFIX + "/")


def is_gateway(scope: Scope) -> bool:
    """Whether the request was authenticated with the serving token."""
    return scope.get(_GATEWAY_SCOPE_KEY) is True


def bearer_of(scope: Scope) -> bytes | None:
    """The bearer credential of the request's `Authorization` header: None without one (or with
    an empty one), empty when the header holds no bearer credential."""
    for name, value in scope["headers"]:
        if name == b"authorization" and value.strip():
            if value[: len(_SCHEME)].lower() != _SCHEME:
                return b""
            return value[len(_SCHEME) :].strip()
    return None


class ServingAuthMiddleware:
    def __init__(self, app: ASGIApp, token: str):
        self.app = app
        self._token = token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_guarded(scope["path"]):
            await self.app(scope, receive, send)
            return
        given = bearer_of(scope)
        # Constant time, so that the answer's timing says nothing about how much of a guess
        # was right.
        if given and hmac.compare_digest(given, self._token):
            await self.app({**scope, _GATEWAY_SCOPE_KEY: True}, receive, send)
            return
        if given is None:
            message = (
                "Missing bearer token: this node serves only requests with "
                "`Authorization: Bearer <serving token>`"
            )
            code = MISSING_CREDENTIAL
        else:
            message, code = "Invalid serving token", INVALID_CREDENTIAL
        response = JSONResponse(
            error_body(401, message, code),
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )
        await response(scope, receive, send)
