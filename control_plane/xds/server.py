"""The ADS server (grpc.aio, state of the world): snapshots from the fleet, pushed to every Envoy.

One `XdsServer` per control plane, started and stopped by the app's lifespan. It keeps a snapshot
for each group of connected Envoys and rebuilds it whenever the region summaries' change feed moves,
and at least every `refresh_interval_s` (capacity that shifts between nodes of a region can leave
the summary unchanged); a group's snapshot is rebuilt only when its plan differs, and streams are
woken only when a version changed. A snapshot that fails validation is logged and counted, never
pushed: Envoy keeps the last good one. `wait_for_ack` lets a drain wait until every Envoy that
routes to a region has accepted a configuration that satisfies a condition.

Every stream is admitted by the `StreamGate` (`control_plane.xds.stream_gate`) before any of its
requests is read: an Envoy's credential, for the role and region its node asks for. `recheck`
closes the streams whose credential has since been replaced or deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from control_plane.changes import ChangeFeed
from control_plane.model import Fleet, Listed
from control_plane.xds.acks import AckCondition, AckWait
from control_plane.xds.cache import SnapshotCache
from control_plane.xds.credentials import EnvoyCredential
from control_plane.xds.groups import EnvoyGroup, EnvoyNodeError, group_of
from control_plane.xds.plan import (
    EnvoyPlan,
    NodesByRegion,
    Pickers,
    nodes_by_region,
    pickers_of,
    plan_for,
)
from control_plane.xds.resources import ENDPOINT_TYPE, SHORT_NAMES
from control_plane.xds.snapshot import InvalidSnapshotError, Snapshot, build_snapshot
from control_plane.xds.stream import RequestKind, StreamState
from control_plane.xds.stream_gate import StreamGate, StreamRefusal, group_refusal
from wire.errors import INVALID_CREDENTIAL

logger = logging.getLogger(__name__)

STOP_GRACE_S = 0.2
# At most one rebuild per this many seconds, however fast the summaries move (a thousand nodes
# registering within a second move them a thousand times): bounds the cost, adds at most this.
MIN_REFRESH_GAP_S = 0.05
SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),  # a port already taken must fail loudly, not be shared
    ("grpc.keepalive_time_ms", 30_000),  # find Envoys that vanished without closing
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),  # Envoy's keepalive pings
    ("grpc.http2.max_ping_strikes", 0),
]


class XdsStartError(RuntimeError):
    """The ADS server could not listen (the port is taken, or the address is wrong)."""


@dataclass(slots=True)
class EnvoyConnection:
    """One ADS stream: the Envoy behind it once its first request named it."""

    stream_id: int
    peer: str
    connected_at: float  # Unix seconds
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    node_id: str = ""
    group: EnvoyGroup | None = None
    state: StreamState | None = None
    credential: EnvoyCredential | None = None
    refusal: StreamRefusal | None = None
    sent_at_mono: dict[str, float] = field(default_factory=dict)
    ack_latency_ms: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ServerTls:
    """The xDS port's certificate (chain) and key, PEM."""

    cert_pem: bytes
    key_pem: bytes


@dataclass(slots=True)
class XdsCounters:
    num_responses: Counter[str] = field(default_factory=Counter)  # by short type name
    num_acks: Counter[str] = field(default_factory=Counter)
    num_nacks: Counter[str] = field(default_factory=Counter)
    num_stale: Counter[str] = field(default_factory=Counter)
    num_invalid_snapshots: int = 0
    num_refused_streams: int = 0  # unauthenticated ones included


class XdsServer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    def __init__(
        self,
        fleet: Fleet,
        feed: ChangeFeed,
        refresh_interval_s: float,
        gate: StreamGate,
        read_listed: Callable[[], Listed],
        pickers: Pickers | None = None,
    ) -> None:
        """`read_listed`: the models the catalog lets be routed to now (None: all), as the
        current region summaries have them (the feed moves when they change). `pickers`: the
        regions with an endpoint picker, and where it listens (control_plane/xds/picker.py)."""
        self.cache = SnapshotCache()
        self.counters = XdsCounters()
        self.port: int | None = None
        self._fleet = fleet
        self._feed = feed
        self._refresh_interval_s = refresh_interval_s
        self._gate = gate
        self._read_listed = read_listed
        self._pickers = pickers or {}
        self._plans: dict[EnvoyGroup, EnvoyPlan] = {}
        self._connections: dict[int, EnvoyConnection] = {}
        self._stream_ids = itertools.count(1)
        self._verdicts = ChangeFeed(1)  # moves on every ACK, NACK and disconnect
        self._server: grpc.aio.Server | None = None
        self._refresher: asyncio.Task[None] | None = None
        self._is_stopped = False

    @property
    def connections(self) -> list[EnvoyConnection]:
        return [c for c in self._connections.values() if c.state is not None]

    # --- lifecycle ---

    async def start(self, host: str, port: int, tls: ServerTls | None = None) -> int:
        """Listen on host:port (0: any free port), with TLS if given; returns the port."""
        server = grpc.aio.server(options=SERVER_OPTIONS)
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(self, server)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            if tls is None:
                self.port = server.add_insecure_port(address)
            else:
                credentials = grpc.ssl_server_credentials([(tls.key_pem, tls.cert_pem)])
                self.port = server.add_secure_port(address, credentials)
        except RuntimeError as exc:
            raise XdsStartError(f"xDS server cannot listen on {address}: {exc}") from exc
        await server.start()
        self._server = server
        self._refresher = asyncio.create_task(self._refresh_forever())
        secure = "TLS" if tls is not None else "plaintext"
        logger.info("xDS (ADS) server listening on %s:%d (%s)", host, self.port, secure)
        return self.port

    async def stop(self) -> None:
        self._is_stopped = True
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        if self._server is not None:
            await self._server.stop(STOP_GRACE_S)
        self._verdicts.close()

    # --- snapshots ---

    def refresh(self) -> int:
        """Rebuild the snapshot of every connected group whose plan changed; returns how many
        changed version."""
        by_region = nodes_by_region(self._fleet)
        return sum(self._rebuild(group, by_region) for group in self.cache.watched_groups())

    def _rebuild(self, group: EnvoyGroup, by_region: NodesByRegion | None = None) -> bool:
        pickers = pickers_of(self._fleet, self._pickers)
        plan = plan_for(group, self._fleet, by_region, self._read_listed(), pickers)
        old = self._plans.get(group)
        if plan == old and self.cache.get(group) is not None:
            return False
        self._plans[group] = plan
        if plan.skipped_node_ids and (old is None or old.skipped_node_ids != plan.skipped_node_ids):
            logger.warning(
                "xDS %s: nodes %s have no plain-HTTP IP URL and get no traffic through Envoy",
                group.label,
                ", ".join(plan.skipped_node_ids),
            )
        try:
            snapshot = build_snapshot(plan)
        except InvalidSnapshotError as exc:
            self.counters.num_invalid_snapshots += 1
            logger.error("xDS %s: not pushing an invalid snapshot: %s", group.label, exc)
            return False
        return self.cache.set_snapshot(group, snapshot)

    def _snapshot_for(self, group: EnvoyGroup) -> Snapshot | None:
        if self.cache.get(group) is None:
            self._rebuild(group)
        return self.cache.get(group)

    async def _refresh_forever(self) -> None:
        index = self._feed.index
        while True:
            started = time.monotonic()
            index = await self._feed.wait_past(index, self._refresh_interval_s)
            gap_s = MIN_REFRESH_GAP_S - (time.monotonic() - started)
            if gap_s > 0:
                await asyncio.sleep(gap_s)  # changes coming in a burst share one rebuild
                index = self._feed.index
            try:
                self.refresh()
            except Exception:
                logger.exception("xDS refresh failed")

    # --- the ADS stream ---

    async def StreamAggregatedResources(
        self,
        request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        conn = EnvoyConnection(next(self._stream_ids), context.peer(), time.time())
        admitted = await self._gate.admit(context.invocation_metadata() or ())
        if isinstance(admitted, StreamRefusal):
            conn.refusal = admitted
            await self._refuse(conn, context)  # raises: the stream ends here
            return
        conn.credential = admitted
        self._connections[conn.stream_id] = conn  # from now on `recheck` sees it
        reader = asyncio.create_task(self._read(conn, request_iterator))
        reader.add_done_callback(lambda _: conn.wake.set())
        try:
            while True:
                await conn.wake.wait()
                conn.wake.clear()
                if conn.refusal is not None:
                    await self._refuse(conn, context)
                if reader.done():
                    return  # Envoy closed its side
                for response in self._take_responses(conn):
                    yield response
        finally:
            reader.cancel()
            self._forget(conn)

    async def _read(
        self, conn: EnvoyConnection, requests: AsyncIterator[discovery_pb2.DiscoveryRequest]
    ) -> None:
        async for request in requests:
            if conn.state is None and not self._register(conn, request):
                return
            assert conn.state is not None
            kind = conn.state.on_request(request)
            self._record(conn, request.type_url, kind)
            conn.wake.set()

    async def _refuse(self, conn: EnvoyConnection, context: grpc.aio.ServicerContext) -> None:
        refusal = conn.refusal
        assert refusal is not None
        self.counters.num_refused_streams += 1
        await self._gate.record(conn.peer, conn.node_id, conn.credential, refusal)
        await context.abort(refusal.code, refusal.message)

    async def recheck(self) -> int:
        """Close the streams whose credential was replaced or deleted since they opened; returns
        how many."""
        held = [c.credential for c in self._connections.values() if c.credential is not None]
        revoked = await self._gate.revoked(held)
        closing = [
            conn
            for conn in list(self._connections.values())
            if conn.credential is not None and conn.credential.name in revoked
        ]
        for conn in closing:
            assert conn.credential is not None
            message = f"xDS credential {conn.credential.name!r} was replaced or deleted"
            code = grpc.StatusCode.UNAUTHENTICATED
            conn.refusal = StreamRefusal(code, INVALID_CREDENTIAL, message)
            conn.wake.set()
        return len(closing)

    def _register(self, conn: EnvoyConnection, request: discovery_pb2.DiscoveryRequest) -> bool:
        try:
            group = group_of(request.node)
        except EnvoyNodeError as exc:
            logger.warning("refusing an xDS stream from %s: %s", conn.peer, exc)
            refusal = StreamRefusal(grpc.StatusCode.INVALID_ARGUMENT, "invalid_node", str(exc))
            conn.refusal = refusal
            return False
        assert conn.credential is not None
        conn.refusal = group_refusal(conn.credential, group)
        if conn.refusal is not None:
            conn.node_id = request.node.id
            return False
        if self._snapshot_for(group) is None:
            message = f"no valid configuration for {group.label}"
            conn.refusal = StreamRefusal(grpc.StatusCode.UNAVAILABLE, "no_configuration", message)
            return False
        conn.group, conn.node_id = group, request.node.id or conn.peer
        conn.state = StreamState(label=conn.node_id)
        self.cache.watch(group, conn.wake)
        logger.info("Envoy %s (%s) connected from %s", conn.node_id, group.label, conn.peer)
        return True

    def _record(self, conn: EnvoyConnection, type_url: str, kind: RequestKind) -> None:
        name = SHORT_NAMES.get(type_url, type_url)
        if kind is RequestKind.ACK:
            self.counters.num_acks[name] += 1
            sent_at = conn.sent_at_mono.get(type_url)
            if sent_at is not None:
                conn.ack_latency_ms[type_url] = round((time.monotonic() - sent_at) * 1000, 3)
        elif kind is RequestKind.NACK:
            self.counters.num_nacks[name] += 1
        elif kind is RequestKind.STALE:
            self.counters.num_stale[name] += 1
        if kind in (RequestKind.ACK, RequestKind.NACK):
            self._verdicts.advance()

    def _take_responses(self, conn: EnvoyConnection) -> list[discovery_pb2.DiscoveryResponse]:
        if conn.group is None or conn.state is None:
            return []
        snapshot = self._snapshot_for(conn.group)
        if snapshot is None:
            return []
        responses = conn.state.take_responses(snapshot)
        now = time.monotonic()
        for response in responses:
            conn.sent_at_mono[response.type_url] = now
            self.counters.num_responses[SHORT_NAMES.get(response.type_url, response.type_url)] += 1
        return responses

    def _forget(self, conn: EnvoyConnection) -> None:
        if self._connections.pop(conn.stream_id, None) is None or conn.group is None:
            return
        self.cache.unwatch(conn.group, conn.wake)
        if conn.group not in self.cache.watched_groups():
            self._plans.pop(conn.group, None)
        self._verdicts.advance()
        logger.info("Envoy %s (%s) disconnected", conn.node_id, conn.group.label)

    # --- waiting for Envoys to accept a configuration ---

    def _has_accepted(self, conn: EnvoyConnection, type_url: str, condition: AckCondition) -> bool:
        assert conn.state is not None
        state = conn.state.types.get(type_url)
        if state is None or state.acked is None:
            return False
        if isinstance(condition, str):
            return state.acked.version == condition
        return condition(state.acked)

    def num_envoys_for(self, region: str) -> int:
        """Connected Envoys that route to `region`: its ingress Envoys and every edge Envoy."""
        return sum(1 for c in self.connections if c.group is not None and c.group.covers(region))

    def lagging(
        self, region: str, condition: AckCondition, type_url: str = ENDPOINT_TYPE
    ) -> list[str]:
        """Node ids of connected Envoys routing to `region` whose accepted `type_url` resources
        do not meet `condition` (a version string, or a predicate on the resources)."""
        return [
            conn.node_id
            for conn in self.connections
            if conn.group is not None
            and conn.group.covers(region)
            and not self._has_accepted(conn, type_url, condition)
        ]

    async def wait_for_ack(
        self,
        region: str,
        condition: AckCondition,
        timeout_s: float,
        type_url: str = ENDPOINT_TYPE,
    ) -> AckWait:
        """Wait until every connected Envoy that routes to `region` (its ingress Envoys and every
        edge Envoy) has ACKed `type_url` resources meeting `condition`, at most `timeout_s`.

        E.g. `await xds.wait_for_ack("us-east", lacks_endpoint(node_url), 5.0)` after a drain.
        Envoys that disconnect stop counting (a reconnecting one gets the current snapshot); with
        none connected the wait is complete at once.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            index = self._verdicts.index
            lagging = self.lagging(region, condition, type_url)
            num_envoys = self.num_envoys_for(region)
            if not lagging:
                return AckWait(is_complete=True, num_envoys=num_envoys)
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0 or self._is_stopped:
                return AckWait(is_complete=False, num_envoys=num_envoys, lagging=tuple(lagging))
            await self._verdicts.wait_past(index, remaining_s)
