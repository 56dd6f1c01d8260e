"""The control plane's bounds on connections, on real sockets against the admin API as
`python -m control_plane` serves it: a TLS handshake never finished, a connection that sends
nothing or a head a byte at a time (the first request's or a later one's) are closed; one client
address holds at most its cap while others are served; a 9 KB header is 431 in the error shape
(wire/connection_guard.py, wire/uvicorn_server.py)."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme
from conftest import ThreadedServer, bearer, make_settings
from slow_clients import (
    begin_tls,
    connect,
    error_of,
    held,
    is_closed,
    read_answer,
    request_head,
    trickle_until_closed,
    wait_closed,
)

from control_plane.app import create_app
from control_plane.tokens import TokenSet

SHORT_S = 1.0  # every bound these tests wait out


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def start(tmp_path: Path, tokens: TokenSet, ca: trustme.CA) -> Iterator[Any]:
    """Factory: a control plane on loopback with short connection bounds; its port."""
    servers: list[ThreadedServer] = []

    def start(is_tls: bool = False, **overrides: Any) -> int:
        if is_tls:
            cert = ca.issue_cert("127.0.0.1")
            cert_path, key_path = tmp_path / "cp.pem", tmp_path / "cp.key"
            cert.cert_chain_pems[0].write_to_path(str(cert_path))
            cert.private_key_pem.write_to_path(str(key_path))
            overrides |= {"tls_cert": cert_path, "tls_key": key_path}
        limits = {
            "tls_handshake_timeout_s": SHORT_S,
            "header_timeout_s": SHORT_S,
            "keepalive_timeout_s": SHORT_S,
        }
        settings = make_settings(tmp_path / "cp.db", tokens, **(limits | overrides))
        server = ThreadedServer(create_app(settings), settings)
        servers.append(server)
        return int(server.start().rsplit(":", 1)[1])

    yield start
    for server in servers:
        server.stop()


@pytest.mark.slow  # seconds of waiting on timeouts
def test_unfinished_handshakes_and_silent_connections_are_closed(
    start: Any, ca: trustme.CA
) -> None:
    port = start(is_tls=True)
    handshakes = [begin_tls(port) for _ in range(10)]
    silent = [connect(port) for _ in range(10)]
    with held(handshakes + silent) as socks:
        wait_closed(socks)
    verifying = ssl.create_default_context()
    ca.configure_trust(verifying)
    with httpx.Client(verify=verifying) as client:  # and a client that finishes is served
        assert client.get(f"https://127.0.0.1:{port}/openapi.json").status_code == 200


@pytest.mark.slow  # seconds of waiting on timeouts
def test_heads_sent_a_byte_at_a_time_are_cut_off(start: Any) -> None:
    port = start()
    head = request_head(headers={f"x-pad-{i}": "p" * 50 for i in range(100)})
    with held([connect(port)]) as (first,):
        assert trickle_until_closed(first, head) < len(head)
    # A later request on a kept-alive connection gets no more time than the first.
    with held([connect(port)]) as (kept,):
        kept.sendall(request_head("/openapi.json"))
        assert read_answer(kept)[0] == 200
        assert trickle_until_closed(kept, head) < len(head)


def test_one_address_holds_at_most_its_cap_while_others_are_served(start: Any) -> None:
    # Held connections must outlast the test: only the cap may close them.
    port = start(max_connections_per_address=4, header_timeout_s=60.0)
    with held([connect(port) for _ in range(4)]) as holding:
        with held([connect(port)]) as over:
            wait_closed(over)
        assert not any(is_closed(sock) for sock in holding)
        transport = httpx.HTTPTransport(local_address="127.0.0.2")
        with httpx.Client(transport=transport) as other:
            assert other.get(f"http://127.0.0.1:{port}/openapi.json").status_code == 200
    with httpx.Client() as again:  # once they are gone, the address is served again
        assert again.get(f"http://127.0.0.1:{port}/openapi.json").status_code == 200


def test_a_9_kb_header_is_431_in_the_error_shape(start: Any, tokens: TokenSet) -> None:
    port = start()
    with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
        response = client.get("/v1/status", headers=bearer(tokens.admin) | {"x-big": "b" * 9216})
        assert response.status_code == 431, response.text
        assert error_of(response.content)["code"] == "headers_too_large"
    # A head far past the cap is cut off while it is read, with the same answer (a plain
    # socket: the server closes before the head's end, and httpx would fail on sending it).
    with held([connect(port)]) as (sock,):
        with contextlib.suppress(ConnectionError):
            sock.sendall(request_head("/v1/status", {"x-huge": "h" * 1024 * 1024}))
        status, _, body = read_answer(sock)
    assert status == 431, body
    assert error_of(body)["code"] == "headers_too_large"
