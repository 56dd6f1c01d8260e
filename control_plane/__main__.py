"""`python -m control_plane`: arguments → settings → logging → serve the admin API."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pydantic import ValidationError

from control_plane.app import create_app
from control_plane.server import ControlPlaneServer
from control_plane.settings import Settings
from control_plane.store import open_store
from control_plane.store.base import StoreError
from control_plane.tokens import ENV_NAMES, TokenKind
from control_plane.xds import bootstrap
from wire.addresses import is_loopback_host
from wire.connection_guard import bind_socket
from wire.validation import one_line

logger = logging.getLogger("control_plane")

NODE_TOKEN_ENV = ENV_NAMES[TokenKind.NODE]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m control_plane",
        description="Meridian control plane. Tokens come from MERIDIAN_ADMIN_TOKEN and "
        "MERIDIAN_GATEWAY_TOKEN; on a loopback host, missing ones are generated into a token "
        "file next to the database. Node agents have no shared token: each gets its own "
        "(POST /v1/nodes/{id}/credential).",
        epilog="`python -m control_plane envoy-bootstrap --help`: print an Envoy bootstrap.",
    )
    parser.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="admin API port (default 8080)")
    parser.add_argument("--xds-port", type=int, help="xDS (ADS) port for Envoy (default 18000)")
    parser.add_argument("--dns-port", type=int, help="simulated authoritative DNS port (8053)")
    parser.add_argument("--consul", dest="consul_addr", help="Consul HTTP address (optional)")
    parser.add_argument(
        "--db", dest="db_path", help="SQLite database file, or a postgresql:// URL (replicas)"
    )
    parser.add_argument("--token-file", help="where loopback-generated tokens are kept")
    parser.add_argument("--tls-cert", help="PEM certificate (chain): HTTPS and TLS for xDS")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument("--heartbeat-interval", dest="heartbeat_interval_s", type=float)
    parser.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser.parse_args(argv)


def load_settings(args: argparse.Namespace) -> Settings:
    overrides = {name: value for name, value in vars(args).items() if value is not None}
    return Settings(**overrides)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["envoy-bootstrap"]:
        return bootstrap.main(argv[1:])
    args = parse_args(argv)
    try:
        settings = load_settings(args)
    except ValidationError as exc:
        print(f"control_plane: bad configuration: {one_line(exc)}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:  # at once, in one line, rather than as a failed start-up inside uvicorn
        open_store(settings.db_path, settings.db_busy_timeout_s).close()
    except StoreError as exc:
        print(f"control_plane: {exc}", file=sys.stderr)
        return 2
    try:
        sock = bind_socket(settings.host, settings.port)
    except OSError as exc:
        where = f"{settings.host}:{settings.port}"
        print(f"control_plane: cannot listen on {where}: {exc.strerror}", file=sys.stderr)
        return 1
    app = create_app(settings)
    if NODE_TOKEN_ENV in os.environ:
        logger.warning(
            "%s is set but no longer read: each node agent needs its own credential "
            "(POST /v1/nodes/{id}/credential, or admin_cli node credentials)",
            NODE_TOKEN_ENV,
        )
    if not settings.is_tls and not is_loopback_host(settings.host):
        logger.warning(
            "serving plain HTTP and xDS on %s: tokens cross the network in the clear "
            "(give --tls-cert and --tls-key)",
            settings.host,
        )
    logger.info(
        "admin API on %s://%s:%d (db %s), xDS%s on port %d, DNS on udp port %d, Consul %s",
        "https" if settings.is_tls else "http",
        settings.host,
        settings.port,
        settings.db_path,
        " (TLS)" if settings.is_tls else "",
        settings.xds_port,
        settings.dns_port,
        settings.consul_addr or "off",
    )
    server = ControlPlaneServer(app, settings)
    server.run(sockets=[sock])
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
