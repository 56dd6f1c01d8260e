"""Caps on request size, checked before routing and before any token: 413 for a body past
`max_body_bytes`, 431 for headers past `max_header_bytes`, in the OpenAI error shape; a body is
never read past the cap."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import pytest
from conftest import ControlPlaneClient

MIB = 1024 * 1024
READ_TIMEOUT_S = 20.0  # generous: the answer should come at once; this only stops a hang


def assert_error(status: int, body: bytes, expected_status: int, code: str) -> None:
    assert status == expected_status, body[:200]
    error = json.loads(body)["error"]
    assert error["code"] == code and "larger than" in error["message"]


def raw_request(
    base_url: str, head: bytes, body_parts: list[bytes], close: bool = False
) -> tuple[int, bytes]:
    """Send the request head and `body_parts` (and no more), then read the answer. A server that
    wanted the rest of the body would never answer: the read times out. (`close`: a complete
    request; ask for the connection to be closed after the answer.) A plain socket, because a
    server that answers before reading a body resets the connection when it closes: the answer
    arrives before the reset, and the kernel hands it over first (asyncio's streams drop it)."""
    host, port = base_url.removeprefix("http://").split(":")
    if close:
        head = head.replace(b"Host: cp\r\n", b"Host: cp\r\nConnection: close\r\n")
    answer = b""
    with socket.create_connection((host, int(port)), timeout=READ_TIMEOUT_S) as sock:
        with contextlib.suppress(ConnectionError):  # it answered (and closed) before the end
            for part in [head, *body_parts]:
                sock.sendall(part)
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    headers, _, body = rest.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in headers.lower():
        body = body.split(b"\r\n", 1)[1].rsplit(b"\r\n0\r\n", 1)[0]
    return int(status_line.split()[1]), body


def post_head(path: str, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: cp", "Content-Type: application/json"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@pytest.mark.asyncio
async def test_a_body_over_the_cap_is_413_before_the_token_is_checked(
    live_cp: ControlPlaneClient,
) -> None:
    # Content-Length says 2 MiB (64 MB alike); only the first 64 KiB are sent, and the answer
    # comes anyway: the body is not waited for, let alone read.
    for length in (2 * MIB, 64 * MIB):
        for token in ({}, live_cp.admin):
            head = post_head("/v1/regions", token | {"Content-Length": str(length)})
            status, body = await asyncio.to_thread(
                raw_request, live_cp.base_url, head, [b"{" * 64 * 1024]
            )
            assert_error(status, body, 413, "body_too_large")
    # Just under the cap goes on to routing as before (here: no token, 401).
    response = await live_cp.http.post("/v1/nodes/heartbeat", content=b"x" * (MIB - 100))
    assert response.status_code == 401


@pytest.mark.asyncio
async def test_a_chunked_body_is_cut_off_at_the_cap(live_cp: ControlPlaneClient) -> None:
    chunk = b"%x\r\n%s\r\n" % (64 * 1024, b"x" * 64 * 1024)
    head = post_head("/v1/nodes/heartbeat", {"Transfer-Encoding": "chunked"})
    # Just past 1 MiB sent, and the body never finished: only a server that stops at the cap
    # answers.
    status, body = await asyncio.to_thread(raw_request, live_cp.base_url, head, [chunk] * 17)
    assert_error(status, body, 413, "body_too_large")
    # Within the cap, a chunked body is read and handed on whole.
    small = b'{"name": "chunked", "lat": 1, "lon": 2}'
    end = b"%x\r\n%s\r\n0\r\n\r\n" % (len(small), small)
    head = post_head("/v1/regions", {"Transfer-Encoding": "chunked"} | live_cp.admin)
    status, body = await asyncio.to_thread(
        raw_request, live_cp.base_url, head + end, [], close=True
    )
    assert status == 201, body


@pytest.mark.asyncio
async def test_headers_over_the_cap_are_431(live_cp: ControlPlaneClient) -> None:
    for headers in ({"X-Padding": "p" * 32 * 1024}, {f"X-Pad-{i}": "p" * 100 for i in range(200)}):
        response = await live_cp.http.get("/v1/status", headers=live_cp.admin | headers)
        assert_error(response.status_code, response.content, 431, "headers_too_large")
    response = await live_cp.http.get("/v1/status", headers=live_cp.admin | {"X-Small": "p" * 4000})
    assert response.status_code == 200
