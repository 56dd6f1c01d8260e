"""The RTT proxy adds one simulated round trip per exchange, keeps a stream's chunks in order and
spaced as sent, spreads connections over its upstreams; and the stack's TLS is verifiable."""

from __future__ import annotations

import argparse
import asyncio
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from stack.certs import ensure_gateway_tls
from stack.rtt_proxy import Route, RttProxy, parse_route

async_test = pytest.mark.asyncio


async def _start_upstream(tag: bytes) -> asyncio.Server:
    """Answers each line with `tag` + the line; `stream` gets 3 lines 50 ms apart."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := await reader.readline():
            if line == b"stream\n":
                for i in range(3):
                    writer.write(tag + b"chunk%d\n" % i)
                    await writer.drain()
                    await asyncio.sleep(0.05)
            else:
                writer.write(tag + line)
                await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def _port(server: asyncio.Server) -> int:
    return int(server.sockets[0].getsockname()[1])


@pytest_asyncio.fixture
async def upstreams() -> AsyncIterator[list[asyncio.Server]]:
    servers = [await _start_upstream(b"a:"), await _start_upstream(b"b:")]
    yield servers
    for server in servers:
        server.close()
        await server.wait_closed()


async def _proxy(upstreams: list[asyncio.Server], rtt_ms: float) -> tuple[RttProxy, int]:
    route = Route(("127.0.0.1", 0), tuple(("127.0.0.1", _port(s)) for s in upstreams), rtt_ms)
    proxy = RttProxy([route])
    await proxy.start()
    return proxy, int(proxy._servers[0].sockets[0].getsockname()[1])


async def _ask(port: int, line: bytes) -> tuple[bytes, float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.monotonic()
    writer.write(line)
    await writer.drain()
    answer = await reader.readline()
    elapsed = time.monotonic() - started
    writer.close()
    await writer.wait_closed()
    return answer, elapsed


@async_test
async def test_each_exchange_takes_one_rtt_longer(upstreams: list[asyncio.Server]) -> None:
    fast, fast_port = await _proxy(upstreams[:1], 0.0)
    slow, slow_port = await _proxy(upstreams[:1], 120.0)
    try:
        answer, fast_s = await _ask(fast_port, b"hello\n")
        assert answer == b"a:hello\n"
        answer, slow_s = await _ask(slow_port, b"hello\n")
        assert answer == b"a:hello\n"
        assert 0.12 <= slow_s < 0.12 + 5.0  # the RTT added; the bound only says it did not hang
        assert fast_s < slow_s  # none added: how fast a loaded machine answers is no claim here
    finally:
        await fast.close()
        await slow.close()


@async_test
async def test_a_stream_keeps_its_order_and_spacing(upstreams: list[asyncio.Server]) -> None:
    proxy, port = await _proxy(upstreams[:1], 100.0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        started = time.monotonic()
        writer.write(b"stream\n")
        arrivals = []
        for _ in range(3):
            arrivals.append((await reader.readline(), time.monotonic() - started))
        writer.close()
        await writer.wait_closed()
    finally:
        await proxy.close()
    assert [line for line, _ in arrivals] == [b"a:chunk0\n", b"a:chunk1\n", b"a:chunk2\n"]
    first_s = arrivals[0][1]
    assert first_s >= 0.1
    gaps = [arrivals[i + 1][1] - arrivals[i][1] for i in range(2)]
    assert all(0.03 <= gap < 0.2 for gap in gaps), gaps  # spaced as sent, not bunched


@async_test
async def test_connections_go_round_robin_over_upstreams(
    upstreams: list[asyncio.Server],
) -> None:
    proxy, port = await _proxy(upstreams, 0.0)
    try:
        answers = [(await _ask(port, b"x\n"))[0] for _ in range(4)]
    finally:
        await proxy.close()
    assert answers == [b"a:x\n", b"b:x\n", b"a:x\n", b"b:x\n"]


@async_test
async def test_an_unreachable_upstream_closes_the_client() -> None:
    route = Route(("127.0.0.1", 0), (("127.0.0.1", 1),), 0.0)
    proxy = RttProxy([route])
    await proxy.start()
    port = int(proxy._servers[0].sockets[0].getsockname()[1])
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        await writer.wait_closed()
    finally:
        await proxy.close()


def test_route_syntax() -> None:
    route = parse_route("127.0.0.1:10201=127.0.0.1:9001,127.0.0.1:9002@76.5")
    assert route == Route(("127.0.0.1", 10201), (("127.0.0.1", 9001), ("127.0.0.1", 9002)), 76.5)
    for bad in ("127.0.0.1:1=127.0.0.1:2", "x=127.0.0.1:2@1", "127.0.0.1:1=127.0.0.1:2@-1"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected LISTEN=UPSTREAM"):
            parse_route(bad)


@async_test
async def test_gateway_certificate_verifies_against_the_stack_ca(tmp_path: Path) -> None:
    tls = ensure_gateway_tls(tmp_path / "tls")
    assert tls.key.stat().st_mode & 0o777 == 0o600
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(tls.cert, tls.key)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"hi\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_context)
    client_context = ssl.create_default_context(cafile=str(tls.ca_cert))
    client_context.verify_flags |= ssl.VERIFY_X509_STRICT
    try:
        for host in ("127.0.0.1", "localhost"):
            reader, writer = await asyncio.open_connection(
                host, _port(server), ssl=client_context, server_hostname=host
            )
            assert await reader.readline() == b"hi\n"
            writer.close()
            await writer.wait_closed()
    finally:
        server.close()
        await server.wait_closed()
    # Kept across runs: clients told to trust the CA keep trusting the gateway.
    ca_before = tls.ca_cert.read_bytes()
    assert ensure_gateway_tls(tmp_path / "tls").ca_cert.read_bytes() == ca_before
