"""The gateway's bounds on connections, on real sockets against a live TLS gateway: a handshake
never finished, a connection that sends nothing or a head a byte at a time, an idle kept-alive
connection are all closed; one client address holds at most its cap of connections while others
are served; headers over the cap are 431 in the error shape (wire/connection_guard.py,
gateway/http_limits.py)."""

from __future__ import annotations

import socket
import ssl
from typing import Any

import httpx
import pytest
from gw_fleet import Fleet, GatewayThread
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

SHORT_S = 1.0  # every bound these tests wait out


def start_gateway(fleet: Fleet, **overrides: Any) -> GatewayThread:
    limits = {
        "tls_handshake_timeout_s": SHORT_S,
        "header_timeout_s": SHORT_S,
        "keepalive_timeout_s": SHORT_S,
    }
    return fleet.start_gateway(**(limits | overrides))


def tls_connect(gateway: GatewayThread, client_ssl: ssl.SSLContext) -> socket.socket:
    return client_ssl.wrap_socket(connect(gateway.port), server_hostname="127.0.0.1")


def get_health(gateway: GatewayThread, client_ssl: ssl.SSLContext, source: str) -> int:
    transport = httpx.HTTPTransport(verify=client_ssl, local_address=source)
    with httpx.Client(transport=transport, base_url=gateway.base_url, timeout=20.0) as client:
        return client.get("/health").status_code


@pytest.mark.slow  # seconds of waiting on timeouts
def test_unfinished_handshakes_and_silent_connections_are_closed(fleet: Fleet) -> None:
    gateway = start_gateway(fleet)
    handshakes = [begin_tls(gateway.port) for _ in range(10)]
    silent = [connect(gateway.port) for _ in range(10)]
    with held(handshakes + silent) as socks:
        wait_closed(socks)


@pytest.mark.slow  # seconds of waiting on timeouts
def test_a_head_sent_a_byte_at_a_time_or_never_is_cut_off(
    fleet: Fleet, client_ssl: ssl.SSLContext
) -> None:
    gateway = start_gateway(fleet)
    with held([tls_connect(gateway, client_ssl)]) as (trickling,):
        head = request_head(headers={f"x-pad-{i}": "p" * 50 for i in range(100)})
        assert trickle_until_closed(trickling, head) < len(head)
    with held([tls_connect(gateway, client_ssl)]) as silent:  # handshake done, then nothing
        wait_closed(silent)


def test_an_idle_kept_alive_connection_is_closed(fleet: Fleet, client_ssl: ssl.SSLContext) -> None:
    gateway = start_gateway(fleet)
    with held([tls_connect(gateway, client_ssl)]) as (sock,):
        sock.sendall(request_head())
        status, headers, _ = read_answer(sock)
        assert status in (200, 503) and headers.get("connection") != "close"
        assert not is_closed(sock)
        wait_closed([sock])


def test_one_address_holds_at_most_its_cap_while_others_are_served(
    fleet: Fleet, client_ssl: ssl.SSLContext
) -> None:
    # Held connections must outlast the test: only the cap may close them.
    gateway = start_gateway(fleet, max_connections_per_address=4, tls_handshake_timeout_s=60.0)
    with held([connect(gateway.port) for _ in range(4)]) as holding:
        with held([connect(gateway.port)]) as over:
            wait_closed(over)
        assert not any(is_closed(sock) for sock in holding)
        assert get_health(gateway, client_ssl, source="127.0.0.2") in (200, 503)
    # Once they are gone, the address is served again.
    assert get_health(gateway, client_ssl, source="127.0.0.1") in (200, 503)


@pytest.mark.parametrize(
    "headers",
    [{"x-big": "b" * 9 * 1024}, {f"x-pad-{i}": "p" * 3000 for i in range(3)}],
    ids=["one header over aiohttp's line limit", "several under it, over the cap in all"],
)
def test_headers_over_the_cap_are_431_in_the_error_shape(
    fleet: Fleet, client_ssl: ssl.SSLContext, headers: dict[str, str]
) -> None:
    gateway = start_gateway(fleet)
    with held([tls_connect(gateway, client_ssl)]) as (sock,):
        sock.sendall(request_head(headers=headers))
        status, answer_headers, body = read_answer(sock)
    assert status == 431, body
    assert answer_headers["content-type"].startswith("application/json")
    assert error_of(body)["code"] == "headers_too_large"
    within = {"x-medium": "m" * 4096}
    with held([tls_connect(gateway, client_ssl)]) as (sock,):
        sock.sendall(request_head(headers=within))
        assert read_answer(sock)[0] in (200, 503)
