"""Bearer-token authentication: which kind of caller (admin, node, gateway) a request comes from.

A missing or unknown token is 401; a valid token of another kind is 403. The presented token is
compared with both shared tokens (admin, gateway) in constant time (`hmac.compare_digest`),
without stopping at the first match, so timing reveals neither the tokens nor which kind matched.
A node's own credential is found by its token's hash (`control_plane.fleet.credentials`).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from control_plane.audit import Actor
from control_plane.errors import AuthenticationError, PermissionDeniedError
from control_plane.fleet.credentials import NodeCredential
from control_plane.services import ControlPlane, ServicesDep
from control_plane.tokens import ENV_NAMES, TokenKind, TokenSet
from wire.errors import INVALID_CREDENTIAL, MISSING_CREDENTIAL

MAX_AGENT_LEN = 120


def match_token(tokens: TokenSet, presented: str) -> TokenKind | None:
    presented_bytes = presented.encode("utf-8")
    matched: TokenKind | None = None
    for kind, token in tokens.items():
        if hmac.compare_digest(presented_bytes, token.encode("utf-8")):
            matched = kind
    return matched


def _describe_client(request: Request) -> str:
    address = f"{request.client.host}:{request.client.port}" if request.client else "unknown"
    agent = request.headers.get("user-agent", "")[:MAX_AGENT_LEN]
    return f"{address} ({agent})" if agent else address


def _scheme(kind: TokenKind) -> HTTPBearer:
    # auto_error=False: we raise our own 401 (the JSON error shape) when the header is missing.
    return HTTPBearer(
        auto_error=False,
        scheme_name=f"{kind.value}Token",
        description=f"Bearer token: the value of {ENV_NAMES[kind]}.",
    )


Credentials = HTTPAuthorizationCredentials | None
# The bearer token a route takes, each kind under its own OpenAPI security scheme.
AdminBearer = Annotated[Credentials, Depends(_scheme(TokenKind.ADMIN))]
NodeBearer = Annotated[Credentials, Depends(_scheme(TokenKind.NODE))]
GatewayBearer = Annotated[Credentials, Depends(_scheme(TokenKind.GATEWAY))]


@dataclass(frozen=True, slots=True)
class NodeCaller:
    """A node agent, and the credential that says which node it may speak for."""

    actor: Actor
    credential: NodeCredential


def authenticate(
    kind: TokenKind, request: Request, services: ControlPlane, credentials: Credentials
) -> Actor:
    if credentials is None:
        # HTTPBearer reads another scheme as no credential; a header that holds one is a bad one.
        if request.headers.get("authorization", "").strip():
            raise AuthenticationError("invalid bearer token", INVALID_CREDENTIAL)
        raise AuthenticationError("missing bearer token", MISSING_CREDENTIAL)
    presented = credentials.credentials
    matched = match_token(services.tokens, presented)
    if matched is None and services.credentials.find(presented) is not None:
        matched = TokenKind.NODE
    if matched is None:
        raise AuthenticationError("invalid bearer token", INVALID_CREDENTIAL)
    if matched is not kind:
        raise PermissionDeniedError(
            f"this route needs the {kind.value} token, not the {matched.value} token",
            "wrong_token_kind",
            matched.value,
        )
    return Actor(kind=matched.value, client=_describe_client(request))


async def require_admin(request: Request, services: ServicesDep, token: AdminBearer) -> Actor:
    return authenticate(TokenKind.ADMIN, request, services, token)


async def require_gateway(request: Request, services: ServicesDep, token: GatewayBearer) -> Actor:
    return authenticate(TokenKind.GATEWAY, request, services, token)


async def require_node(request: Request, services: ServicesDep, token: NodeBearer) -> NodeCaller:
    actor = authenticate(TokenKind.NODE, request, services, token)
    assert token is not None
    credential = services.credentials.find(token.credentials)
    assert credential is not None
    return NodeCaller(actor, credential)


# The dependencies are `async def` (they never block) so FastAPI runs them on the event loop
# rather than handing each one to its thread pool: at 1,000 heartbeats a second that hand-off
# cost more than the heartbeat itself.
AdminAuth = Annotated[Actor, Depends(require_admin)]
NodeAuth = Annotated[NodeCaller, Depends(require_node)]
GatewayAuth = Annotated[Actor, Depends(require_gateway)]
