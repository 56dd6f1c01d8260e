"""The stack's own small servers as processes (the RTT proxy, the Anycast front): logging set up
once, the server run until SIGTERM or SIGINT, a port that cannot be bound said in one line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Coroutine
from typing import Any

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def add_log_level_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"])


def stop_on_signals() -> asyncio.Event:
    """An event that SIGTERM or SIGINT sets, from now on (call it inside the running loop)."""
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopped.set)
    return stopped


def run_server(prog: str, log_level: str, server: Coroutine[Any, Any, None]) -> int:
    """Run `server` to its end; the exit status (1: it could not listen)."""
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    try:
        asyncio.run(server)
    except OSError as exc:
        print(f"{prog}: error: cannot listen: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0
