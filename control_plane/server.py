"""Serving the admin API: uvicorn behind the connection guard (wire/uvicorn_server.py), which also
does the TLS, so that a handshake is bounded and a client address is counted before it."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from types import FrameType

from fastapi import FastAPI
from uvicorn.config import SSL_PROTOCOL_VERSION, create_ssl_context

from control_plane.services import ControlPlane
from control_plane.settings import Settings
from wire.config_fields import config_from
from wire.connection_guard import ConnectionLimits
from wire.uvicorn_server import GuardedServer

# Long-polling gateways hold requests open for up to `wait`; do not let them delay shutdown.
GRACEFUL_SHUTDOWN_S = 2


def tls_context(settings: Settings) -> ssl.SSLContext | None:
    """The context uvicorn would make of the certificate and key (None: plain HTTP)."""
    if settings.tls_cert is None:
        return None
    return create_ssl_context(
        certfile=settings.tls_cert,
        keyfile=settings.tls_key,
        password=None,
        ssl_version=SSL_PROTOCOL_VERSION,
        cert_reqs=ssl.CERT_NONE,
        ca_certs=None,
        ciphers=None,
    )


class ControlPlaneServer(GuardedServer):
    """Telling the app the moment a stop begins (`ControlPlane.begin_stop`)."""

    def __init__(self, app: FastAPI, settings: Settings) -> None:
        super().__init__(
            app,
            config_from(ConnectionLimits, settings),
            settings.max_header_bytes,
            tls_context(settings),
            log_level=settings.log_level,
            graceful_shutdown_s=GRACEFUL_SHUTDOWN_S,
        )
        self._app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        services = getattr(self._app.state, "services", None)
        if isinstance(services, ControlPlane):
            # A signal handler may interrupt the event loop anywhere: run it as a callback.
            with contextlib.suppress(RuntimeError):  # no loop running: nothing to tell
                asyncio.get_running_loop().call_soon_threadsafe(services.begin_stop)
        super().handle_exit(sig, frame)
