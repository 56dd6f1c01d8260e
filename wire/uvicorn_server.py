"""uvicorn as the node agent and the control plane run it: behind the connection guard
(wire/connection_guard.py), with what uvicorn itself does not bound.

- Each request head has `header_timeout_s` from its first byte: uvicorn's keep-alive timer stops
  at that byte and nothing else runs, so one header byte now and then held a connection for ever.
- A head is cut off while it is read once it passes twice `max_header_bytes` (the request line and
  the headers may each reach the cap) past the read it began in: httptools keeps any amount. The
  answer is 431; a complete head over the cap is the ASGI middleware's to refuse
  (wire/request_limits.py), with the same answer.
- What the parser refuses is answered in the OpenAI error shape (uvicorn's is text/plain).
- No WebSocket upgrades: neither service has a WebSocket route, and an upgraded connection would
  leave the guard, whose count would then never drop.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.server import ServerState

from wire.connection_guard import ConnectionGuard, ConnectionLimits, GuardedListener
from wire.errors import error_json
from wire.request_limits import headers_too_large


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None,
        header_timeout_s: float,
        max_header_bytes: int,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._header_timeout_s = header_timeout_s
        self._max_header_bytes = max_header_bytes
        self._head_timer: asyncio.TimerHandle | None = None
        # What arrived of the head being read after the read it began in (which may hold the
        # end of the previous request too); None: between heads.
        self._num_head_bytes: int | None = None

    def data_received(self, data: bytes) -> None:
        if self._num_head_bytes is not None:
            self._num_head_bytes += len(data)
        super().data_received(data)
        if self._num_head_bytes is not None and self._num_head_bytes > 2 * self._max_header_bytes:
            self._refuse(431, headers_too_large(self._max_header_bytes))

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._num_head_bytes = 0
        self._head_timer = self.loop.call_later(self._header_timeout_s, self._on_head_timeout)

    def on_headers_complete(self) -> None:
        self._end_head()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._end_head()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, msg)

    def _on_head_timeout(self) -> None:
        self._head_timer = None
        self.transport.abort()

    def _end_head(self) -> None:
        self._num_head_bytes = None
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _refuse(self, status: int, message: str) -> None:
        """Answer an error the app never saw, and close."""
        self._end_head()
        if self.transport.is_closing():
            return
        body = error_json(status, message)
        content = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            content.extend([name, b": ", value, b"\r\n"])
        content.append(b"content-type: application/json\r\n")
        content.append(b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body))
        content.append(body)
        self.transport.write(b"".join(content))
        self.transport.close()


class GuardedServer(uvicorn.Server):
    """A uvicorn server that accepts on the sockets given to `serve`/`run` through a
    `GuardedListener` (which does the TLS, if any: uvicorn is given none) rather than
    `loop.create_server`."""

    def __init__(
        self,
        app: Any,
        limits: ConnectionLimits,
        max_header_bytes: int,
        tls: ssl.SSLContext | None = None,
        *,
        log_level: str,
        graceful_shutdown_s: float,
    ) -> None:
        super().__init__(
            uvicorn.Config(
                app,
                ws="none",
                lifespan="on",
                log_level=log_level.lower(),
                access_log=False,
                timeout_keep_alive=limits.keepalive_timeout_s,  # type: ignore[arg-type]
                timeout_graceful_shutdown=graceful_shutdown_s,  # type: ignore[arg-type]
            )
        )
        self.guard = ConnectionGuard(limits, tls)
        self._max_header_bytes = max_header_bytes
        self._listeners: list[asyncio.Task[None]] = []
        self.sockets: list[socket.socket] = []

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        # Listening before uvicorn says it has started; uvicorn runs the lifespan and serves no
        # socket of its own.
        if not sockets:
            raise ValueError("serve() needs the bound sockets (wire.connection_guard.bind_socket)")
        self.sockets = sockets
        listeners = [GuardedListener(sock, self.guard, self._new_protocol) for sock in self.sockets]
        await super().startup(sockets=[])
        loop = asyncio.get_running_loop()
        self._listeners = [loop.create_task(listener.serve()) for listener in listeners]

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for task in self._listeners:
            task.cancel()
        for sock in self.sockets:
            sock.close()
        self.guard.close()
        await super().shutdown(sockets)

    def _new_protocol(self) -> asyncio.Protocol:
        return BoundedHttpToolsProtocol(
            self.config,
            self.server_state,
            self.lifespan.state,
            None,
            self.guard.limits.header_timeout_s,
            self._max_header_bytes,
        )
