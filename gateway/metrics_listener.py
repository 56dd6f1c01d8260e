"""The metrics listener: Prometheus text at `/metrics` on an address of its own (plain HTTP,
127.0.0.1:9464 by default), never on the public port, where counts by region and key would let
anyone list the tenants and watch their volume. With a metrics token set, a scrape must send
`Authorization: Bearer <token>` (required to listen off loopback: settings.py).
"""

from __future__ import annotations

import hmac
import socket
from collections.abc import Callable, Iterable

from aiohttp import web
from aiohttp.typedefs import Middleware
from pydantic import SecretStr

from gateway.errors import AuthenticationError
from wire.errors import INVALID_CREDENTIAL, MISSING_CREDENTIAL

CONTENT_TYPE = "text/plain; version=0.0.4"


class MetricsListener:
    """`/metrics` on a bound socket; the app's lifespan starts and stops it."""

    def __init__(
        self,
        sock: socket.socket,
        render: Callable[[], bytes],
        token: SecretStr | None,
        middlewares: Iterable[Middleware] = (),
    ) -> None:
        self._sock = sock
        self._render = render
        self._token = token.get_secret_value().encode() if token is not None else None
        app = web.Application(middlewares=middlewares)
        app.router.add_get("/metrics", self._metrics, allow_head=False)
        self._runner = web.AppRunner(app, access_log=None)

    @property
    def url(self) -> str:
        host, port = self._sock.getsockname()[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"

    async def start(self) -> None:
        await self._runner.setup()
        await web.SockSite(self._runner, self._sock).start()

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.Response:
        if self._token is not None:
            _check_bearer(request.headers.get("Authorization"), self._token)
        return web.Response(body=self._render(), headers={"content-type": CONTENT_TYPE})


def _check_bearer(authorization: str | None, token: bytes) -> None:
    if not authorization or not authorization.strip():
        raise AuthenticationError(
            "Missing metrics token: send 'Authorization: Bearer <metrics token>'",
            MISSING_CREDENTIAL,
        )
    scheme, _, given = authorization.partition(" ")
    # Constant time, so that the answer's timing says nothing about how much of a guess was right.
    is_valid = scheme.lower() == "bearer" and hmac.compare_digest(
        given.strip().encode("utf-8", "replace"), token
    )
    if not is_valid:
        raise AuthenticationError("Invalid metrics token", INVALID_CREDENTIAL)
