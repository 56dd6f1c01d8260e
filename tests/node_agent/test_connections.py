"""The node agent's bounds on connections and requests, on real sockets against a live node: a
connection that sends nothing or a head a byte at a time (the first request's or a later one's)
is closed; one client address holds at most its cap while others are served; headers over the
cap are 431 and a body over the cap 413, in the error shape, without the body being read, while
the node keeps answering (wire/connection_guard.py, wire/uvicorn_server.py,
wire/request_limits.py)."""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fake_engine import FakeEngine
from node_helpers import BackgroundLoop, NodeHandle, start_node
from slow_clients import (
    connect,
    error_of,
    held,
    is_closed,
    read_answer,
    request_head,
    trickle_until_closed,
    wait_closed,
)

SHORT_S = 1.0  # every bound these tests wait out
MIB = 1024 * 1024
ANSWER_TIMEOUT_S = 20.0  # a hang guard: the answers come at once


@pytest.fixture
def start(server_loop: BackgroundLoop, fake_llm: FakeEngine) -> Iterator[Any]:
    """Factory: a node over the shared fake engine, with short connection bounds and `overrides`."""
    nodes: list[NodeHandle] = []

    def start(**overrides: Any) -> NodeHandle:
        limits = {"header_timeout_s": SHORT_S, "keepalive_timeout_s": SHORT_S}
        node = start_node(server_loop, fake_llm, **(limits | overrides))
        nodes.append(node)
        return node

    yield start
    for node in nodes:
        node.stop()


def post_head(path: str, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: node", "Content-Type: application/json"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def answer_to(port: int, head: bytes, body_parts: list[bytes]) -> tuple[int, bytes]:
    """Send the head and `body_parts` (no more), then read the answer: a server that waited for
    the rest of the body would never answer (the read times out)."""
    with held([connect(port)]) as (sock,):
        with contextlib.suppress(ConnectionError):  # it answered (and closed) before the end
            for part in [head, *body_parts]:
                sock.sendall(part)
        status, _, body = read_answer(sock)
    return status, body


@pytest.mark.slow  # seconds of waiting on timeouts
def test_silent_connections_and_slow_heads_are_closed(start: Any) -> None:
    node = start()
    port = node.settings.port
    with held([connect(port) for _ in range(10)]) as silent:
        wait_closed(silent)
    head = request_head(headers={f"x-pad-{i}": "p" * 50 for i in range(100)})
    with held([connect(port)]) as (first,):
        assert trickle_until_closed(first, head) < len(head)
    # A later request on a kept-alive connection gets no more time than the first.
    with held([connect(port)]) as (kept,):
        kept.sendall(request_head())
        assert read_answer(kept)[0] == 200
        assert trickle_until_closed(kept, head) < len(head)


def test_an_idle_kept_alive_connection_is_closed(start: Any) -> None:
    node = start()
    with held([connect(node.settings.port)]) as (sock,):
        sock.sendall(request_head())
        assert read_answer(sock)[0] == 200
        assert not is_closed(sock)
        wait_closed([sock])


def test_one_address_holds_at_most_its_cap_while_others_are_served(start: Any) -> None:
    # Held connections must outlast the test: only the cap may close them.
    node = start(max_connections_per_address=4, header_timeout_s=60.0)
    port = node.settings.port
    with held([connect(port) for _ in range(4)]) as holding:
        with held([connect(port)]) as over:
            wait_closed(over)
        assert not any(is_closed(sock) for sock in holding)
        transport = httpx.HTTPTransport(local_address="127.0.0.2")
        with httpx.Client(transport=transport, timeout=ANSWER_TIMEOUT_S) as other:
            assert other.get(node.base_url + "/health").status_code == 200
    with node.client() as again:  # once they are gone, the address is served again
        assert again.get("/health").status_code == 200


def test_headers_over_the_cap_are_431_in_the_error_shape(start: Any) -> None:
    node = start()
    with node.client() as http:
        for headers in ({"x-big": "b" * 9 * 1024}, {f"x-pad-{i}": "p" * 3000 for i in range(3)}):
            response = http.get("/health", headers=headers)
            assert response.status_code == 431, response.text
            assert error_of(response.content)["code"] == "headers_too_large"
            assert response.headers["x-request-id"]
        assert http.get("/health", headers={"x-medium": "m" * 4096}).status_code == 200


def test_a_body_over_the_cap_is_413_without_being_read(start: Any) -> None:
    node = start()
    port = node.settings.port
    # 50 MB by its Content-Length, of which only 64 KiB are sent: the answer comes anyway.
    head = post_head("/v1/completions", {"Content-Length": str(50 * 1000 * 1000)})
    status, body = answer_to(port, head, [b"{" * 64 * 1024])
    assert status == 413, body
    assert error_of(body)["code"] == "body_too_large"
    # Chunked, just past 8 MiB and never finished: only a node that stops at the cap answers.
    chunk = b"%x\r\n%s\r\n" % (MIB, b"x" * MIB)
    head = post_head("/v1/completions", {"Transfer-Encoding": "chunked"})
    status, body = answer_to(port, head, [chunk] * 9)
    assert status == 413, body


def send_chunked_prompt(port: int, num_bytes: int) -> int:
    """POST a completion whose prompt is `num_bytes` long, chunked; the status of the answer."""
    with held([connect(port)]) as (sock,):
        sock.sendall(post_head("/v1/completions", {"Transfer-Encoding": "chunked"}))
        parts = [b'{"model": "smollm2-135m-instruct", "max_tokens": 1, "prompt": "']
        parts += [b"word " * (MIB // 5)] * (num_bytes // MIB) + [b'"}']
        with contextlib.suppress(ConnectionError):
            for part in parts:
                sock.sendall(b"%x\r\n%s\r\n" % (len(part), part))
            sock.sendall(b"0\r\n\r\n")
        return read_answer(sock)[0]


def test_the_node_keeps_answering_while_a_50_mb_body_arrives(start: Any) -> None:
    node = start()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        upload = pool.submit(send_chunked_prompt, node.settings.port, 50 * MIB)
        with node.client() as http:
            while not upload.done():
                assert http.get("/health").status_code == 200
        assert upload.result() == 413


def test_a_body_within_the_cap_is_served(start: Any) -> None:
    node = start()
    body = {"model": "smollm2-135m-instruct", "prompt": "Hello", "max_tokens": 1}
    with node.client() as http:
        response = http.post("/v1/completions", json=body, headers={"x-pad": "p" * 100})
    assert response.status_code == 200, response.text
