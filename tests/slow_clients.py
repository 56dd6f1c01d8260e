"""Clients that hold a server's connections without finishing what they started, on real sockets:
a TCP connection that sends nothing, a TLS handshake begun and never finished, a request head
sent a byte at a time. The tests of every service's connection limits use them
(tests/*/test_*connections.py)."""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import time
from collections.abc import Iterator
from typing import Any

# Long enough for a loaded machine; only reached by a server that never closes.
HANG_GUARD_S = 20.0
POLL_S = 0.02


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    """A TCP connection to 127.0.0.1:`port` from the loopback address `source`."""
    sock = socket.create_connection(
        ("127.0.0.1", port), timeout=HANG_GUARD_S, source_address=(source, 0)
    )
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def begin_tls(port: int) -> socket.socket:
    """A TCP connection that has sent a real ClientHello and will send nothing more."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    sock = connect(port)
    sock.sendall(outgoing.read())
    return sock


def is_closed(sock: socket.socket) -> bool:
    """Whether the server has closed (or reset) the connection; what it sent first is skipped."""
    sock.setblocking(False)
    try:
        while True:
            if not sock.recv(65536):
                return True
    except (BlockingIOError, ssl.SSLWantReadError):
        return False
    except (ConnectionError, ssl.SSLError):
        return True
    finally:
        sock.setblocking(True)


def wait_closed(socks: list[socket.socket], timeout_s: float = HANG_GUARD_S) -> float:
    """Seconds until the server has closed every one of `socks` (AssertionError past the guard)."""
    started = time.monotonic()
    open_ = list(socks)
    while open_:
        open_ = [sock for sock in open_ if not is_closed(sock)]
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"{len(open_)} of {len(socks)} connections still open")
        time.sleep(POLL_S)
    return time.monotonic() - started


def trickle_until_closed(sock: socket.socket, head: bytes, every_s: float = 0.1) -> int:
    """Send `head` a byte at a time until the server closes the connection; the bytes sent."""
    started = time.monotonic()
    for num_sent, byte in enumerate(head):
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            return num_sent
        if is_closed(sock):
            return num_sent + 1
        if time.monotonic() - started > HANG_GUARD_S:
            break
        time.sleep(every_s)
    raise AssertionError("the server kept reading the head to its end")


@contextlib.contextmanager
def held(socks: list[socket.socket]) -> Iterator[list[socket.socket]]:
    try:
        yield socks
    finally:
        for sock in socks:
            sock.close()


def read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 answer with a Content-Length (status, headers, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {
        name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)
    }
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed in the middle of a body"
        body += chunk
    return int(status_line.split()[1]), headers, body


def request_head(path: str = "/health", headers: dict[str, str] | None = None) -> bytes:
    lines = [f"GET {path} HTTP/1.1", "Host: 127.0.0.1"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def error_of(body: bytes) -> dict[str, Any]:
    error: dict[str, Any] = json.loads(body)["error"]
    return error
