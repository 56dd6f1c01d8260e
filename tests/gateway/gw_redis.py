"""A real redis-server for the gateway's tests, on a free loopback port (Debian's `redis-server`:
tests that need it skip when it is missing)."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

REDIS_SERVER = shutil.which("redis-server")


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
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.02)
        yield process
    finally:
        process.kill()
        process.wait(timeout=10)
