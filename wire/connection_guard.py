"""Bounds every service puts on a connection below HTTP: how many one client address may hold at
once, how long its TLS handshake may take, and how long it may take to send its first request
head. Without them a client held a connection for ever by never finishing its handshake, by
sending nothing, or by sending one header byte now and then (slowloris).

A `GuardedListener` accepts on the service's listening socket itself (not `loop.create_server`,
which hands a connection over only once its handshake is done, and takes no handshake timeout
through uvicorn): it counts each connection by its peer address at once, before any handshake,
and closes one over the cap. The loop then runs the handshake (`connect_accepted_socket`,
bounded by `tls_handshake_timeout_s`) and hands the connection to a `GuardedConnection` in front
of the HTTP server's protocol (aiohttp's or uvicorn's). Until the first request head is
complete (its blank line has arrived) a timer runs: past `header_timeout_s` the connection is
dropped. Later requests on a kept-alive connection are the HTTP server's to bound (its
keep-alive timer, and for uvicorn a deadline on every head: wire/uvicorn_server.py).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, cast

logger = logging.getLogger(__name__)

HEAD_END: Final = b"\r\n\r\n"
BACKLOG: Final = 4096
# A refused address is logged at most this often (an attacker must not flood the log).
REFUSAL_LOG_INTERVAL_S: Final = 10.0
# Out of file descriptors (or memory): accepting again at once would spin.
ACCEPT_RETRY_S: Final = 0.5
_OUT_OF_RESOURCES: Final = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_HANDSHAKE_ERRORS: Final = (OSError, ssl.SSLError, TimeoutError, ConnectionError)


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    # Connections one peer address may hold at once (0: no cap, for a server behind a proxy
    # that all clients share the address of).
    max_connections_per_address: int
    # From the end of the TLS handshake (or accept) to the end of the first request head.
    header_timeout_s: float
    # Kept-alive connections idle longer than this are closed (by the HTTP server).
    keepalive_timeout_s: float
    tls_handshake_timeout_s: float = 10.0  # for a server with TLS


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound (not yet listening) socket: a taken port fails at once, before anything loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class ConnectionGuard:
    """One server's connections: counted per address, and their handshakes in flight."""

    def __init__(self, limits: ConnectionLimits, tls: ssl.SSLContext | None = None) -> None:
        self.limits = limits
        self.tls = tls
        self._num_by_address: dict[str, int] = {}
        self._handshakes: set[asyncio.Task[None]] = set()
        self._last_refusal_log = -REFUSAL_LOG_INTERVAL_S
        self._num_refused_unlogged = 0

    def num_connections(self, address: str) -> int:
        return self._num_by_address.get(address, 0)

    def admit(self, address: str) -> bool:
        num = self._num_by_address.get(address, 0)
        cap = self.limits.max_connections_per_address
        if cap and num >= cap:
            self._log_refusal(address)
            return False
        self._num_by_address[address] = num + 1
        return True

    def release(self, address: str) -> None:
        num = self._num_by_address[address] - 1
        if num:
            self._num_by_address[address] = num
        else:
            del self._num_by_address[address]

    def track(self, handshake: asyncio.Task[None]) -> None:
        self._handshakes.add(handshake)
        handshake.add_done_callback(self._handshakes.discard)

    def close(self) -> None:
        """Drop the connections still in their handshake (the server is stopping)."""
        for task in list(self._handshakes):
            task.cancel()

    def _log_refusal(self, address: str) -> None:
        self._num_refused_unlogged += 1
        now = time.monotonic()
        if now - self._last_refusal_log < REFUSAL_LOG_INTERVAL_S:
            return
        logger.warning(
            "refused %d connections over the cap of %d per address (latest from %s)",
            self._num_refused_unlogged,
            self.limits.max_connections_per_address,
            address,
        )
        self._last_refusal_log = now
        self._num_refused_unlogged = 0


class GuardedConnection(asyncio.Protocol):
    """One admitted connection, after its handshake: timed until its first request head is
    complete, served by the HTTP server's protocol (made by `new_protocol`)."""

    def __init__(
        self, guard: ConnectionGuard, address: str, new_protocol: Callable[[], asyncio.Protocol]
    ) -> None:
        self._guard = guard
        self._address: str | None = address
        self.http = new_protocol()
        self._transport: asyncio.Transport | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_tail = b""  # the last bytes of the first head so far (its end may straddle)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self.http.connection_made(transport)
        self._head_timer = asyncio.get_running_loop().call_later(
            self._guard.limits.header_timeout_s, self._on_head_timeout
        )

    def data_received(self, data: bytes) -> None:
        if self._head_timer is not None:
            self._watch_head(data)
        self.http.data_received(data)

    def eof_received(self) -> bool | None:
        return self.http.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.release()
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self.http.connection_lost(exc)

    def pause_writing(self) -> None:
        self.http.pause_writing()

    def resume_writing(self) -> None:
        self.http.resume_writing()

    def release(self) -> None:
        """Uncount this connection (once, whichever of loss and a failed handshake comes)."""
        if self._address is not None:
            self._guard.release(self._address)
            self._address = None

    def _watch_head(self, data: bytes) -> None:
        if HEAD_END in data or HEAD_END in self._head_tail + data[:3]:
            assert self._head_timer is not None
            self._head_timer.cancel()
            self._head_timer = None
            self._head_tail = b""
        else:
            self._head_tail = (self._head_tail + data)[-3:]

    def _on_head_timeout(self) -> None:
        self._head_timer = None
        if self._transport is not None:
            self._transport.abort()


class GuardedListener:
    """Listens on a bound socket from the start; accepts through `guard` while `serve()` runs."""

    def __init__(
        self,
        sock: socket.socket,
        guard: ConnectionGuard,
        new_protocol: Callable[[], asyncio.Protocol],
    ) -> None:
        self._sock = sock
        self._guard = guard
        self._new_protocol = new_protocol
        sock.listen(BACKLOG)
        sock.setblocking(False)

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, peer = await loop.sock_accept(self._sock)
            except OSError as exc:
                if exc.errno in _OUT_OF_RESOURCES:
                    logger.warning("cannot accept connections: %s", exc.strerror)
                    await asyncio.sleep(ACCEPT_RETRY_S)
                continue
            address = str(peer[0]) if isinstance(peer, tuple) else str(peer)
            if not self._guard.admit(address):
                conn.close()
                continue
            self._guard.track(loop.create_task(self._connect(conn, address)))

    async def _connect(self, conn: socket.socket, address: str) -> None:
        connection = GuardedConnection(self._guard, address, self._new_protocol)
        loop = asyncio.get_running_loop()
        tls = self._guard.tls
        try:
            if tls is None:
                await loop.connect_accepted_socket(lambda: connection, conn)
            else:
                await loop.connect_accepted_socket(
                    lambda: connection,
                    conn,
                    ssl=tls,
                    ssl_handshake_timeout=self._guard.limits.tls_handshake_timeout_s,
                )
        except _HANDSHAKE_ERRORS:
            connection.release()
            conn.close()
        except asyncio.CancelledError:
            connection.release()
            conn.close()
            raise
