"""DNS messages in and out (dnslib): the authoritative answers for our one zone.

- The API hostname: A / AAAA (ANY: both) with the address of the region (or, when PoPs are
  configured, the gateway PoP) `Steering` picks for the client's subnet — the EDNS Client Subnet
  option when the query has one (echoed back with the scope our answer is valid for), else the
  source address; an ECS option we cannot read is ignored (the source address decides). A
  chosen region without an address of the asked family gives NOERROR with no answer (NODATA).
- The zone apex: SOA and NS (one name server, `ns1.<zone>`, whose address is ours).
- Other names in the zone: NXDOMAIN with the SOA. Names outside it: REFUSED (we are not
  authoritative for them and do not recurse). Non-QUERY opcodes: NOTIMP. Classes other than IN
  and zone transfers: REFUSED. Malformed queries: FORMERR; responses are ignored.
"""

from __future__ import annotations

import ipaddress
import logging
import struct
from dataclasses import dataclass
from typing import Final

from dnslib import AAAA, CLASS, EDNS0, NS, OPCODE, QTYPE, RCODE, RR, SOA, A, DNSHeader, DNSRecord
from dnslib import EDNSOption as DnsOption
from dnslib.buffer import BufferError as DnsBufferError
from dnslib.dns import DNSError

from control_plane.dns.decision import Decision, client_network
from control_plane.dns.steering import Steering
from wire.geo import IPAddress, IPNetwork

logger = logging.getLogger(__name__)

ECS_OPTION: Final = 8  # RFC 7871
ECS_FAMILIES: Final = {1: 4, 2: 6}  # ECS address family → IP version
MAX_UDP_PLAIN: Final = 512  # without EDNS (RFC 1035)
MAX_UDP_EDNS: Final = 1232  # the DNS flag day 2020 size: no IP fragmentation
BADVERS: Final = 16
SOA_REFRESH_S, SOA_RETRY_S, SOA_EXPIRE_S = 3600, 600, 86400
_PARSE_ERRORS = (DNSError, DnsBufferError, struct.error, ValueError, IndexError, UnicodeError)


class MalformedQuery(Exception):
    """The query cannot be answered as asked (FORMERR)."""


@dataclass(frozen=True, slots=True)
class ClientSubnet:
    """An ECS option from a query (RFC 7871)."""

    family: int
    source_prefix_len: int
    address: IPAddress

    def option(self, scope_prefix_len: int) -> DnsOption:
        num_bytes = (self.source_prefix_len + 7) // 8
        data = struct.pack("!HBB", self.family, self.source_prefix_len, scope_prefix_len)
        return DnsOption(ECS_OPTION, data + self.address.packed[:num_bytes])


def parse_ecs(data: bytes) -> ClientSubnet:
    if len(data) < 4:
        raise MalformedQuery("ECS option shorter than 4 bytes")
    family, source_len, scope_len = struct.unpack("!HBB", data[:4])
    version = ECS_FAMILIES.get(family)
    if version is None:
        raise MalformedQuery(f"ECS family {family} unknown")
    size = 4 if version == 4 else 16
    raw = data[4:]
    if source_len > size * 8 or scope_len != 0 or len(raw) != (source_len + 7) // 8:
        raise MalformedQuery("ECS prefix length and address do not agree")
    address = ipaddress.ip_address(raw.ljust(size, b"\0"))
    network = ipaddress.ip_network((address, source_len), strict=False)
    return ClientSubnet(family, source_len, network.network_address)


class Responder:
    """Turns one query datagram into one response datagram (or None: nothing to send)."""

    def __init__(self, steering: Steering, ns_address: IPAddress) -> None:
        config = steering.config
        self._steering = steering
        self._zone = config.zone
        self._hostname = config.hostname
        self._ns_name = f"ns1.{config.zone}"
        self._ns_address = ns_address
        self._ttl_s = config.ttl_s

    def respond(self, packet: bytes, peer: IPAddress) -> bytes | None:
        try:
            request = DNSRecord.parse(packet)
        except _PARSE_ERRORS:
            return self._formerr_of_header(packet)
        if request.header.qr:
            return None  # a response sent to us: never answer those
        try:
            reply, max_size = self._answer(request, peer)
        except MalformedQuery as exc:
            logger.debug("FORMERR to %s: %s", peer, exc)
            reply = self._reply(request, RCODE.FORMERR, is_authoritative=False)
            max_size = MAX_UDP_PLAIN
        except Exception:
            logger.exception("DNS: failed to answer %s", request.q.qname)
            reply = self._reply(request, RCODE.SERVFAIL, is_authoritative=False)
            max_size = MAX_UDP_PLAIN
        return self._pack(reply, max_size)

    def _formerr_of_header(self, packet: bytes) -> bytes | None:
        if len(packet) < 12 or packet[2] & 0x80:  # no header to answer, or a response
            return None
        header = DNSHeader(id=struct.unpack("!H", packet[:2])[0], qr=1, rcode=RCODE.FORMERR)
        return DNSRecord(header=header).pack()

    def _reply(self, request: DNSRecord, rcode: int, is_authoritative: bool) -> DNSRecord:
        header = DNSHeader(
            id=request.header.id,
            qr=1,
            opcode=request.header.opcode,
            aa=int(is_authoritative),
            rd=request.header.rd,
            ra=0,
            rcode=rcode,
        )
        return DNSRecord(header=header, questions=list(request.questions))

    def _answer(self, request: DNSRecord, peer: IPAddress) -> tuple[DNSRecord, int]:
        """The reply, and the largest datagram the client takes."""
        opt = next((rr for rr in request.ar if rr.rtype == QTYPE.OPT), None)
        if opt is None:
            return self._answer_query(request, peer, None)[0], MAX_UDP_PLAIN
        max_size = min(max(MAX_UDP_PLAIN, opt.rclass), MAX_UDP_EDNS)
        if (opt.ttl >> 16) & 0xFF != 0:  # an EDNS version other than 0
            reply = self._reply(request, RCODE.NOERROR, is_authoritative=False)
            reply.add_ar(EDNS0(udp_len=MAX_UDP_EDNS, ext_rcode=BADVERS >> 4))
            return reply, max_size
        ecs = self._client_subnet(opt)
        reply, scope = self._answer_query(request, peer, ecs)
        options = [ecs.option(scope)] if ecs is not None else []
        reply.add_ar(EDNS0(udp_len=MAX_UDP_EDNS, opts=options))
        return reply, max_size

    def _client_subnet(self, opt: RR) -> ClientSubnet | None:
        """The query's ECS option; None without one, or with one we cannot read: that query
        is answered as if it had none (by the source address, no ECS echoed), never refused."""
        for option in opt.rdata:
            if option.code == ECS_OPTION:
                try:
                    return parse_ecs(bytes(option.data))
                except MalformedQuery as exc:
                    logger.debug("DNS: ignoring a malformed ECS option: %s", exc)
                    return None
        return None

    def _answer_query(
        self, request: DNSRecord, peer: IPAddress, ecs: ClientSubnet | None
    ) -> tuple[DNSRecord, int]:
        """The reply and the ECS scope prefix length it is valid for (0: any client)."""
        if request.header.opcode != OPCODE.QUERY:
            return self._reply(request, RCODE.NOTIMP, is_authoritative=False), 0
        if len(request.questions) != 1:
            raise MalformedQuery(f"{len(request.questions)} questions")
        question = request.q
        name = str(question.qname).rstrip(".").lower()
        qtype = question.qtype
        if question.qclass != CLASS.IN or qtype in (QTYPE.AXFR, QTYPE.IXFR):
            return self._reply(request, RCODE.REFUSED, is_authoritative=False), 0
        if name != self._zone and not name.endswith("." + self._zone):
            return self._reply(request, RCODE.REFUSED, is_authoritative=False), 0
        reply = self._reply(request, RCODE.NOERROR, is_authoritative=True)
        if name == self._hostname and qtype in (QTYPE.A, QTYPE.AAAA, QTYPE.ANY):
            return self._answer_hostname(reply, qtype, peer, ecs)
        if name == self._zone:
            if qtype in (QTYPE.SOA, QTYPE.ANY):
                reply.add_answer(self._soa())
            if qtype in (QTYPE.NS, QTYPE.ANY):
                reply.add_answer(RR(self._zone, QTYPE.NS, rdata=NS(self._ns_name), ttl=self._ttl_s))
                reply.add_ar(self._address_rr(self._ns_name, self._ns_address))
        elif name == self._ns_name:
            if qtype in (QTYPE.ANY, self._qtype_of(self._ns_address)):
                reply.add_answer(self._address_rr(self._ns_name, self._ns_address))
        elif name != self._hostname:
            reply.header.rcode = RCODE.NXDOMAIN
        if not reply.rr:
            reply.add_auth(self._soa())  # NXDOMAIN or NODATA: the SOA gives the negative TTL
        return reply, 0

    def _answer_hostname(
        self, reply: DNSRecord, qtype: int, peer: IPAddress, ecs: ClientSubnet | None
    ) -> tuple[DNSRecord, int]:
        if ecs is not None and ecs.source_prefix_len > 0:
            network = client_network(ecs.address, ecs.source_prefix_len)
            scope = network.prefixlen
        else:  # no ECS, or ECS asking us not to use it (source /0): the resolver's address
            network, scope = client_network(peer), 0
        choice = self._steering.decide(network)
        if choice is None:  # no region has an address at all
            reply.header.rcode = RCODE.SERVFAIL
            reply.header.aa = 0
            return reply, scope
        self._log_choice(network, choice)
        for address in choice.target.addresses:
            if qtype in (QTYPE.ANY, self._qtype_of(address)):
                reply.add_answer(self._address_rr(self._hostname, address))
        if not reply.rr:
            reply.add_auth(self._soa())
        return reply, scope

    def _log_choice(self, network: IPNetwork, choice: Decision) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("DNS: %s -> %s (%s)", network, choice.target.name, choice.reason)

    @staticmethod
    def _qtype_of(address: IPAddress) -> int:
        return int(QTYPE.A) if address.version == 4 else int(QTYPE.AAAA)

    def _address_rr(self, name: str, address: IPAddress) -> RR:
        rdata = A(str(address)) if address.version == 4 else AAAA(str(address))
        return RR(name, self._qtype_of(address), rdata=rdata, ttl=self._ttl_s)

    def _soa(self) -> RR:
        serial = self._steering.view().index % 2**32
        times = (serial, SOA_REFRESH_S, SOA_RETRY_S, SOA_EXPIRE_S, self._ttl_s)
        rdata = SOA(self._ns_name, f"hostmaster.{self._zone}", times)
        return RR(self._zone, QTYPE.SOA, rdata=rdata, ttl=self._ttl_s)

    @staticmethod
    def _pack(reply: DNSRecord, max_size: int) -> bytes:
        packet = reply.pack()
        if len(packet) <= max_size:
            return packet
        # Too big for UDP: say so (TC) and let the client retry over TCP.
        reply.rr, reply.auth = [], []
        reply.ar = [rr for rr in reply.ar if rr.rtype == QTYPE.OPT]
        reply.header.tc = 1
        return reply.pack()
