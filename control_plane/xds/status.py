"""What every connected Envoy was sent and accepted: the xDS part of the operators' status view."""

from __future__ import annotations

from pydantic import BaseModel

from control_plane.xds.resources import SHORT_NAMES
from control_plane.xds.server import EnvoyConnection, XdsServer


class XdsTypeStatus(BaseModel):
    sent_version: str | None
    acked_version: str | None  # the last version this Envoy accepted on this stream
    is_reply_pending: bool  # sent, neither ACKed nor NACKed yet
    num_acks: int
    num_nacks: int
    last_error: str | None  # the last NACK's message
    last_ack_latency_ms: float | None  # push → ACK


class EnvoyStatus(BaseModel):
    node_id: str
    role: str
    region: str | None
    listen: str
    peer: str
    connected_at: float
    types: dict[str, XdsTypeStatus]  # by short type name: clusters, endpoints, listeners, routes


class XdsStatus(BaseModel):
    port: int | None
    num_envoys: int
    # Current snapshot versions: group ("ingress/us-east", "edge") → type → version.
    snapshots: dict[str, dict[str, str]]
    num_responses: dict[str, int]
    num_acks: dict[str, int]
    num_nacks: dict[str, int]
    num_stale: dict[str, int]
    num_invalid_snapshots: int  # built from the fleet, failed validation, not pushed
    num_refused_streams: int
    envoys: list[EnvoyStatus]


def _envoy_status(conn: EnvoyConnection) -> EnvoyStatus:
    assert conn.group is not None and conn.state is not None
    types = {
        SHORT_NAMES.get(type_url, type_url): XdsTypeStatus(
            sent_version=state.sent_version,
            acked_version=state.acked_version,
            is_reply_pending=state.is_reply_pending,
            num_acks=state.num_acks,
            num_nacks=state.num_nacks,
            last_error=state.last_error,
            last_ack_latency_ms=conn.ack_latency_ms.get(type_url),
        )
        for type_url, state in conn.state.types.items()
    }
    return EnvoyStatus(
        node_id=conn.node_id,
        role=str(conn.group.role),
        region=conn.group.region,
        listen=f"{conn.group.listen_host}:{conn.group.listen_port}",
        peer=conn.peer,
        connected_at=conn.connected_at,
        types=types,
    )


def status_of(xds: XdsServer) -> XdsStatus:
    counters = xds.counters
    snapshots = {
        group.label: {SHORT_NAMES.get(t, t): version for t, version in snapshot.versions.items()}
        for group, snapshot in sorted(xds.cache.items(), key=lambda item: item[0].label)
    }
    envoys = sorted(xds.connections, key=lambda c: c.node_id)
    return XdsStatus(
        port=xds.port,
        num_envoys=len(envoys),
        snapshots=snapshots,
        num_responses=dict(counters.num_responses),
        num_acks=dict(counters.num_acks),
        num_nacks=dict(counters.num_nacks),
        num_stale=dict(counters.num_stale),
        num_invalid_snapshots=counters.num_invalid_snapshots,
        num_refused_streams=counters.num_refused_streams,
        envoys=[_envoy_status(conn) for conn in envoys],
    )
