"""`meridian up`'s readiness probes answer false, never raise, while a part is not up."""

from __future__ import annotations

import socket

from stack.probes import port_is_open


def test_a_port_is_open_only_while_something_listens() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = int(sock.getsockname()[1])
        probe = port_is_open(port)
        assert probe()
    assert not probe()
