"""Running the app under uvicorn (behind the connection guard: wire/uvicorn_server.py), with
SIGTERM meaning "drain, then exit 0".

uvicorn's own SIGTERM handling closes the listening socket at once and re-raises the signal when
it is done (so the process dies of it). Here the first SIGTERM starts a drain instead: the node
keeps answering (503 for new requests, `/ready` 503, heartbeats say draining) until in-flight
requests finish and, while a control plane is reachable, it has said `may_exit` (at most the
drain timeout; see node_agent/drain.py), then the server stops and the process exits 0. The
control plane's `may_exit` ends the server the same way. A second SIGTERM, or SIGINT,
stops at once, as uvicorn would.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from types import FrameType

from fastapi import FastAPI

from node_agent.runtime import NodeRuntime
from node_agent.settings import NodeAgentSettings
from wire.connection_guard import ConnectionLimits
from wire.uvicorn_server import GuardedServer

GRACEFUL_SHUTDOWN_S = 5


def connection_limits(settings: NodeAgentSettings) -> ConnectionLimits:
    return ConnectionLimits(
        max_connections_per_address=settings.max_connections_per_address,
        header_timeout_s=settings.header_timeout_s,
        keepalive_timeout_s=settings.keepalive_timeout_s,
    )


class NodeServer(GuardedServer):
    def __init__(self, app: FastAPI, settings: NodeAgentSettings):
        super().__init__(
            app,
            connection_limits(settings),
            settings.max_header_bytes,
            log_level=settings.log_level,
            graceful_shutdown_s=GRACEFUL_SHUTDOWN_S,
        )
        self.runtime: NodeRuntime = app.state.runtime
        self.runtime.stop_server = self.stop
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def stop(self) -> None:
        self.should_exit = True

    def drain_and_exit(self, reason: str) -> None:
        """Start a drain that ends the server; callable from any thread."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.runtime.drain.begin, reason, True)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.runtime.drain.will_exit and not self.should_exit:
            self.drain_and_exit("SIGTERM")
            return
        super().handle_exit(sig, frame)
