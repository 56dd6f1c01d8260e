"""The authoritative DNS server on a UDP port, on the control plane's event loop.

Each datagram is answered synchronously from memory inside `datagram_received` (no I/O, no
locks), so the loop is never blocked for longer than building one small message.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from typing import cast

from control_plane.dns.config import DnsConfig
from control_plane.dns.pops import PopHealth
from control_plane.dns.responder import Responder
from control_plane.dns.steering import Steering
from control_plane.summaries import SummaryPublisher
from wire.geo import IPAddress

logger = logging.getLogger(__name__)


LOOPBACK = ipaddress.IPv4Address("127.0.0.1")


class DnsStartError(Exception):
    """The DNS port cannot be bound."""


def _specific_address(host: str) -> IPAddress | None:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    return None if address.is_unspecified else address


class DnsProtocol(asyncio.DatagramProtocol):
    def __init__(self, responder: Responder) -> None:
        self._responder = responder
        self._transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # CPython's selector transport does not subclass DatagramTransport, but is one.
        self._transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        peer = ipaddress.ip_address(str(addr[0]).split("%", 1)[0])
        reply = self._responder.respond(data, peer)
        if reply is not None and self._transport is not None:
            self._transport.sendto(reply, addr)

    def error_received(self, exc: Exception) -> None:
        logger.debug("DNS socket error: %s", exc)


class DnsServer:
    """The DNS part of a running control plane: built with the app, bound by its lifespan."""

    def __init__(self, config: DnsConfig, publisher: SummaryPublisher) -> None:
        self.config = config
        self.pops = PopHealth(config) if config.pops else None
        self.steering = Steering(config, lambda: publisher.current, self.pops)
        self.host = ""
        self.port = 0  # the bound port once started (useful when asked for port 0)
        self._transport: asyncio.DatagramTransport | None = None
        self._checking: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (0: any free port); returns the port."""
        ns_address = self.config.ns_address or _specific_address(host) or LOOPBACK
        responder = Responder(self.steering, ns_address)
        loop = asyncio.get_running_loop()
        try:
            transport, _ = await loop.create_datagram_endpoint(
                lambda: DnsProtocol(responder), local_addr=(host, port)
            )
        except OSError as exc:
            raise DnsStartError(f"DNS server cannot listen on udp {host}:{port}: {exc}") from exc
        self._transport = transport
        self.host, self.port = transport.get_extra_info("sockname")[:2]
        if self.pops is not None:
            self._checking = asyncio.create_task(self.pops.run())
        logger.info(
            "DNS: authoritative for %s on udp %s:%d (%s, TTL %d s)",
            self.config.zone,
            self.host,
            self.port,
            self.config.hostname,
            self.config.ttl_s,
        )
        return self.port

    def stop(self) -> None:
        if self._checking is not None:
            self._checking.cancel()
            self._checking = None
        if self._transport is not None:
            self._transport.close()
            self._transport = None
