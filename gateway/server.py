"""Serving the app: aiohttp.web on uvloop, over TLS (1.2 or newer) or plain HTTP.

The server's access log is off: the gateway writes its own line per request, with the request
id, region and key. Handlers are cancelled when a client's connection drops, so a stream or a
pending upstream request is abandoned at once rather than at its next write. Connections are
bounded below HTTP by the connection guard (a cap per client address, deadlines on the TLS
handshake and the first request head) and above it by aiohttp's keep-alive timer.
"""

from __future__ import annotations

import asyncio
import io
import logging
import socket
import ssl
import sys
from pathlib import Path

from aiohttp import web

from gateway import tls
from gateway.http_limits import GatewayRequestHandler
from gateway.request_ids import RequestIdFilter
from gateway.settings import GatewaySettings
from wire.config_fields import config_from
from wire.connection_guard import ConnectionGuard, ConnectionLimits, GuardedListener

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5.0
LOG_BUFFER_BYTES = 64 * 1024
FLUSH_INTERVAL_S = 0.5
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"


class BufferedStderrHandler(logging.StreamHandler[io.TextIOWrapper]):
    """Log lines to stderr through a 64 KiB buffer, written out every `FLUSH_INTERVAL_S` by
    `flush_logs_periodically`, and at once for warnings and errors.

    Writing each access line straight through costs a system call per request (measured: about
    15% of the gateway's CPU per request); buffering is what nginx's `access_log buffer=` does.
    """

    def __init__(self, fd: int) -> None:
        raw = io.FileIO(fd, "wb", closefd=False)
        binary = io.BufferedWriter(raw, buffer_size=LOG_BUFFER_BYTES)
        super().__init__(io.TextIOWrapper(binary, encoding="utf-8", errors="replace"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.stream.write(self.format(record) + self.terminator)
            if record.levelno >= logging.WARNING:
                self.flush()
        except Exception:
            self.handleError(record)


def configure_logging(level: str) -> logging.Handler:
    """One handler on the root logger whose records all carry the current request id."""
    handler: logging.Handler
    try:
        handler = BufferedStderrHandler(sys.stderr.fileno())
    except (AttributeError, OSError, ValueError):  # stderr is not a file (e.g. captured)
        handler = logging.StreamHandler()
    # No record needs its thread, process or source line (the format shows none): not looked
    # up per record (the logging docs' optimisations; about 1% of a proxied request's CPU).
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging._srcfile = None
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    return handler


async def flush_logs_periodically(handler: logging.Handler) -> None:
    try:
        while True:
            await asyncio.sleep(FLUSH_INTERVAL_S)
            handler.flush()
    finally:
        handler.flush()


def certificate_paths(settings: GatewaySettings) -> tuple[Path, Path] | None:
    """The certificate and key to serve with (made now if self-signed), or None for plain."""
    if settings.tls_mode == "plain":
        return None
    if settings.tls_mode == "self-signed":
        cert_path, key_path = tls.make_self_signed(settings.host, tls.self_signed_dir())
        logger.info("self-signed certificate in %s (trust it, or use --tls-cert)", cert_path)
        return cert_path, key_path
    assert settings.tls_cert is not None and settings.tls_key is not None
    return settings.tls_cert, settings.tls_key


class GatewayServer:
    """The app on a bound socket; `serve()` runs until `stop()` (or cancellation).

    Each accepted connection goes through the connection guard (wire/connection_guard.py), which
    does the TLS handshake too, into the gateway's aiohttp protocol (gateway/http_limits.py).
    """

    def __init__(
        self,
        app: web.Application,
        sock: socket.socket,
        context: ssl.SSLContext | None,
        settings: GatewaySettings,
    ) -> None:
        self.app = app
        self._sock = sock
        self.guard = ConnectionGuard(config_from(ConnectionLimits, settings), context)
        self._settings = settings
        self._runner = web.AppRunner(
            app, handler_cancellation=True, shutdown_timeout=GRACEFUL_SHUTDOWN_S
        )
        self._stopped = asyncio.Event()
        self.is_started = False

    async def serve(self) -> None:
        await self._runner.setup()
        listener = GuardedListener(self._sock, self.guard, self._new_handler)
        accepting = asyncio.create_task(listener.serve())
        self.is_started = True
        try:
            await self._stopped.wait()
        finally:
            accepting.cancel()
            self._sock.close()
            self.guard.close()
            await self._runner.cleanup()

    def stop(self) -> None:
        self._stopped.set()

    def _new_handler(self) -> asyncio.Protocol:
        manager = self._runner.server
        assert manager is not None
        return GatewayRequestHandler(
            manager,
            loop=asyncio.get_running_loop(),
            keepalive_timeout_s=self._settings.keepalive_timeout_s,
            max_header_bytes=self._settings.max_header_bytes,
        )
