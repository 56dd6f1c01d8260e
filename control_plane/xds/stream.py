"""The state of one ADS stream, per resource type: what was sent, what Envoy accepted or rejected.

Pure bookkeeping (no gRPC, no clock), driven by two calls: `on_request` for each DiscoveryRequest
and `take_responses` when a snapshot may hold something new. Per type:

- A request with no nonce subscribes (a new stream, or Envoy starting the type over): answer at
  once with the current snapshot, even if Envoy already holds that version from before a reconnect.
- A request whose nonce is not the last one sent is stale (Envoy answering an older response):
  ignored.
- The first request carrying the last nonce is Envoy's verdict on that response: an ACK records the
  accepted version; a NACK (`error_detail` set) is counted and logged, and Envoy keeps its last good
  version. Either way the type then waits until the snapshot's version differs from the one sent,
  so a rejected version is never sent again in a loop.
- A second request with the same nonce is Envoy asking again without a new response to answer:
  after a Cluster changes, Envoy re-requests its endpoints with the same version and nonce, and the
  cluster stays warming until they come. Always answered, like a change of requested names.
- One response in flight per type; due types go out in Envoy's order (CDS, EDS, LDS, RDS).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import StrEnum

from envoy.service.discovery.v3 import discovery_pb2

from control_plane.xds.resources import CLUSTER_TYPE, LISTENER_TYPE, SHORT_NAMES, TYPE_ORDER
from control_plane.xds.snapshot import Resources, Snapshot

logger = logging.getLogger(__name__)

WILDCARD_TYPES = frozenset({CLUSTER_TYPE, LISTENER_TYPE})  # Envoy asks for all of these
MAX_ERROR_LEN = 1000
NACK_SEPARATOR = "\n: "


class RequestKind(StrEnum):
    SUBSCRIBE = "subscribe"
    ACK = "ack"
    NACK = "nack"
    STALE = "stale"
    REREQUEST = "rerequest"


def nack_message(error_detail: str) -> str:
    """The real error in a NACK: Envoy prefixes it with a marker and a dump of the proto."""
    return " ".join(error_detail.rsplit(NACK_SEPARATOR, 1)[-1].split())[:MAX_ERROR_LEN]


@dataclass(slots=True)
class TypeState:
    names: tuple[str, ...] = ()
    must_respond: bool = False
    sent: Resources | None = None
    sent_nonce: str = ""
    is_reply_pending: bool = False  # sent; Envoy has not ACKed or NACKed it yet
    acked: Resources | None = None  # the last response Envoy accepted on this stream
    acked_version: str | None = None  # ... its version (or the one Envoy claimed on subscribing)
    num_acks: int = 0
    num_nacks: int = 0
    num_stale: int = 0
    last_error: str | None = None

    @property
    def sent_version(self) -> str | None:
        return self.sent.version if self.sent is not None else None

    def is_due(self, current_version: str) -> bool:
        if self.is_reply_pending:
            return False
        return self.must_respond or (self.sent is not None and current_version != self.sent.version)


@dataclass(slots=True)
class StreamState:
    label: str  # for logs: the Envoy's node id
    types: dict[str, TypeState] = field(default_factory=dict)
    num_responses: int = 0

    def on_request(self, request: discovery_pb2.DiscoveryRequest) -> RequestKind:
        state = self.types.setdefault(request.type_url, TypeState())
        names = tuple(sorted(request.resource_names))
        if not request.response_nonce:
            state.names, state.must_respond = names, True
            state.acked_version = request.version_info or state.acked_version
            return RequestKind.SUBSCRIBE
        if request.response_nonce != state.sent_nonce:
            state.num_stale += 1
            return RequestKind.STALE
        if not state.is_reply_pending:
            state.names, state.must_respond = names, True
            return RequestKind.REREQUEST
        state.is_reply_pending = False
        if names != state.names:
            state.names, state.must_respond = names, True
        if request.HasField("error_detail"):
            state.num_nacks += 1
            state.last_error = nack_message(request.error_detail.message)
            logger.warning(
                "Envoy %s rejected %s version %s (keeps %s): %s",
                self.label,
                SHORT_NAMES.get(request.type_url, request.type_url),
                state.sent_version,
                request.version_info or "nothing",
                state.last_error,
            )
            return RequestKind.NACK
        state.num_acks += 1
        state.acked_version = request.version_info
        if request.version_info == state.sent_version:
            state.acked = state.sent
        return RequestKind.ACK

    def take_responses(self, snapshot: Snapshot) -> list[discovery_pb2.DiscoveryResponse]:
        """The responses due now, in Envoy's order; they count as sent."""
        ordered = [t for t in TYPE_ORDER if t in self.types]
        ordered += sorted(t for t in self.types if t not in TYPE_ORDER)
        responses = []
        for type_url in ordered:
            state = self.types[type_url]
            current = snapshot.get(type_url)
            if not state.is_due(current.version):
                continue
            names = None if type_url in WILDCARD_TYPES or not state.names else state.names
            sent = current.select(names)
            self.num_responses += 1
            state.sent, state.sent_nonce = sent, str(self.num_responses)
            state.is_reply_pending, state.must_respond = True, False
            responses.append(sent.response(state.sent_nonce))
        return responses
