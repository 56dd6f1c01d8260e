"""What the services' `python -m` command lines share: the parser, the flags they all read alike
(where to listen, the log level, the control plane to report to), and the one line on stderr a
failed start ends with."""

from __future__ import annotations

import argparse
import sys

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def service_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """`python -m PROG`'s parser. A flag not given is left out of the namespace, so that the
    service's settings take it from the environment, a file or their default."""
    return argparse.ArgumentParser(
        prog=f"python -m {prog}", description=description, argument_default=argparse.SUPPRESS
    )


def add_listen_flags(parser: argparse.ArgumentParser, default_port: int) -> None:
    parser.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help=f"port to listen on (default {default_port})")


def add_control_plane_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--control-plane",
        help="control plane URL, e.g. http://127.0.0.1:8080; replicas: URL,URL,...",
    )
    parser.add_argument(
        "--control-plane-ca", help="PEM CA file to verify an https:// control plane with"
    )


def add_log_level_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", choices=LOG_LEVELS)


def fail(prog: str, message: str, exit_status: int) -> int:
    """Say why PROG cannot start, in one line on stderr; the exit status to end with."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return exit_status


def cannot_listen(host: str, port: int, exc: OSError, purpose: str = "") -> str:
    """The line for a listening socket that could not be bound (a taken port, most often)."""
    return f"cannot listen on {host}:{port}{purpose}: {exc.strerror}"
