"""`meridian resolve` asks every control-plane replica's DNS in turn: with the first replica
down, the answer comes from the next (a real UDP server on loopback answering as the control
plane's DNS does); with all down, one line names each port tried."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import dns.message
import dns.rrset
import pytest

from stack.errors import StackError
from stack.front_cli import resolve
from stack.state import ProcessRecord, StackState, StateDir
from wire.geo import client_subnet_of

API_NAME = "api.meridian.test"
LONDON = "127.0.1.2"


def _dead_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def live_dns() -> Iterator[int]:
    """A UDP DNS server on loopback that answers the API name with London's PoP address."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                data, client = sock.recvfrom(4096)
            except TimeoutError:
                continue
            query = dns.message.from_wire(data)
            reply = dns.message.make_response(query)
            reply.answer.append(dns.rrset.from_text(API_NAME + ".", 5, "IN", "A", LONDON))
            sock.sendto(reply.to_wire(), client)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield int(sock.getsockname()[1])
    finally:
        stop.set()
        thread.join(timeout=5)
        sock.close()


def _record(state_dir: StateDir, dns_ports: list[int]) -> None:
    state_dir.write(
        StackState(
            supervisor=ProcessRecord("meridian up", "supervisor", 999_999_999, "gone", ""),
            config="test.yaml",
            pops={"new-york": "https://127.0.1.1:8443", "london": f"https://{LONDON}:8443"},
            dns_name=API_NAME,
            dns_port=dns_ports[0],
            dns_ports=dns_ports,
        )
    )


@pytest.mark.slow  # seconds of waiting on timeouts
def test_resolve_moves_on_to_the_next_replica_when_the_first_is_down(
    state_dir: StateDir, live_dns: int
) -> None:
    _record(state_dir, [_dead_udp_port(), live_dns])
    said: list[str] = []
    assert resolve(state_dir.root, "paris", False, said.append) == 0
    subnet = client_subnet_of("paris")
    assert said == [f"paris ({subnet}) → {API_NAME} A {LONDON} (PoP london), TTL 5 s"]


@pytest.mark.slow  # seconds of waiting on timeouts
def test_resolve_names_every_replica_it_tried_when_none_answers(state_dir: StateDir) -> None:
    ports = [_dead_udp_port(), _dead_udp_port()]
    _record(state_dir, ports)
    with pytest.raises(StackError) as raised:
        resolve(state_dir.root, "paris", True, print)
    message = str(raised.value)
    assert message.startswith("no answer from the DNS (udp 127.0.0.1:")
    assert all(f"udp 127.0.0.1:{port}:" in message for port in ports)
