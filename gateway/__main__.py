"""`python -m gateway`: arguments → settings → logging → serve.

Exit status: 0 after a clean stop (SIGTERM or SIGINT: in-flight requests get a few seconds to
finish), 1 if the port is taken or TLS files cannot be loaded, 2 for
bad flags or configuration (one line on stderr saying what is wrong).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.util
import logging
import signal
import ssl
import sys

import uvloop
from pydantic import ValidationError

from gateway.app import create_app
from gateway.server import (
    GatewayServer,
    certificate_paths,
    configure_logging,
    flush_logs_periodically,
)
from gateway.settings import GatewaySettings
from gateway.tls import server_context
from wire import service_cli
from wire.connection_guard import bind_socket
from wire.validation import one_line

PROG = "gateway"
logger = logging.getLogger(PROG)
_fail = functools.partial(service_cli.fail, PROG)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = service_cli.service_parser(
        PROG,
        "Meridian gateway: the HTTPS front door of one point of presence. Its control-plane "
        "token comes from MERIDIAN_GATEWAY_TOKEN, the optional one scrapes of /metrics must "
        "send from MERIDIAN_GATEWAY_METRICS_TOKEN.",
    )
    add = parser.add_argument
    add("--pop", help="this point of presence's name (a place in wire/geo.py)")
    service_cli.add_listen_flags(parser, default_port=8443)
    service_cli.add_control_plane_flags(parser)
    add("--redis", help="redis:// URL to share rate limits with the PoP's other gateways")
    add(
        "--share-prefix-cache",
        action="store_true",
        help="let API keys share nodes' prefix caches (by default each key gets its own, so "
        "that response times cannot reveal another tenant's prompts)",
    )
    tls = parser.add_mutually_exclusive_group()
    tls.add_argument("--tls-cert", help="PEM certificate (chain) to serve; needs --tls-key")
    tls.add_argument(
        "--self-signed",
        dest="tls_mode",
        action="store_const",
        const="self-signed",
        help="make a self-signed certificate at start (the default)",
    )
    tls.add_argument(
        "--plain", dest="tls_mode", action="store_const", const="plain", help="plain HTTP"
    )
    add("--tls-key", help="PEM private key for --tls-cert")
    add(
        "--region-ingress",
        action="append",
        metavar="REGION=URL",
        help="this PoP's own path to a region, instead of its registered ingress (repeatable)",
    )
    add("--auto-model", help="the model the alias `auto` means at the regions")
    add("--edge-url", help="an edge node agent beside this PoP, for light `auto` requests")
    add("--edge-model", help="the model the edge serves (default: --auto-model)")
    add("--edge-max-tokens", type=int, help="a light request's largest max_tokens (64)")
    add("--edge-max-prompt-tokens", type=int, help="a light request's longest prompt (256)")
    add("--edge-max-concurrency", type=int, help="edge requests at once before a region (4)")
    add("--edge-policy", action="append", metavar="KEY_ID=forbid|force", help="per API key")
    add("--default-max-tokens", type=int, help="cap for chat requests without max_tokens (1024)")
    add("--request-deadline", dest="request_deadline_s", type=float, help="seconds (600)")
    add("--metrics-host", help="address of the /metrics listener, plain HTTP (127.0.0.1)")
    add("--metrics-port", type=int, help="port of the /metrics listener (9464; 0: any free)")
    add(
        "--metrics-key-labels",
        action="store_true",
        help="count requests by API key id too (lists the tenants to whoever can scrape)",
    )
    service_cli.add_log_level_flag(parser)
    add("--no-access-log", dest="access_log", action="store_false", help="no line per request")
    return parser.parse_args(argv)


def load_settings(args: argparse.Namespace) -> GatewaySettings:
    values = vars(args)
    if "tls_cert" in values or "tls_key" in values:
        values.setdefault("tls_mode", "files")
    return GatewaySettings(**values)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        settings = load_settings(args)
    except ValidationError as exc:
        return _fail(f"bad configuration: {one_line(exc)}", 2)
    if settings.redis is not None and importlib.util.find_spec("redis") is None:
        return _fail("--redis needs the redis package: pip install 'meridian[redis]'", 2)
    log_handler = configure_logging(settings.log_level)
    try:
        paths = certificate_paths(settings)
        context = server_context(*paths) if paths is not None else None
    except (OSError, ssl.SSLError) as exc:
        return _fail(f"cannot load the TLS certificate or key: {exc}", 1)
    try:
        sock = bind_socket(settings.host, settings.port)
    except OSError as exc:
        return _fail(service_cli.cannot_listen(settings.host, settings.port, exc), 1)
    try:
        metrics_sock = bind_socket(settings.metrics_host, settings.metrics_port)
    except OSError as exc:
        sock.close()
        host, port = settings.metrics_host, settings.metrics_port
        return _fail(service_cli.cannot_listen(host, port, exc, " for metrics"), 1)
    metrics_host, metrics_port = metrics_sock.getsockname()[:2]
    logger.info(
        "gateway %s on %s://%s:%d (metrics on http://%s:%d/metrics), control plane %s, "
        "limits %s, prefix caches %s",
        settings.pop,
        settings.scheme,
        settings.host,
        settings.port,
        metrics_host,
        metrics_port,
        settings.control_plane_url,
        "shared through redis" if settings.redis else "in this process",
        "shared by all keys" if settings.share_prefix_cache else "per key",
    )
    app = create_app(settings, metrics_sock)
    uvloop.run(_serve(GatewayServer(app, sock, context, settings), log_handler))
    return 0


async def _serve(server: GatewayServer, log_handler: logging.Handler) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.stop)
    flusher = asyncio.create_task(flush_logs_periodically(log_handler))
    try:
        await server.serve()
    finally:
        flusher.cancel()
        await asyncio.gather(flusher, return_exceptions=True)


if __name__ == "__main__":
    sys.exit(main())
