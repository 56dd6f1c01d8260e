"""The ADS server's protocol, against a grpc.aio client playing Envoy (with an xDS credential for
its group): first requests answered at once, ACK/NACK bookkeeping per type, stale nonces,
re-requests, Envoy's order, no resend on NACK, refused nodes, invalid snapshots held back, and
`wait_for_ack`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import pytest
import pytest_asyncio
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.rpc import status_pb2
from test_xds_plan import INGRESS, add_node, add_region, two_node_plan

from control_plane.audit import Actor
from control_plane.changes import ChangeFeed
from control_plane.model import Fleet
from control_plane.refusals import RefusalAudit, RefusalLimits
from control_plane.store import open_store
from control_plane.store.base import Store
from control_plane.xds import server as server_module
from control_plane.xds.acks import lacks_endpoint
from control_plane.xds.credentials import EnvoyCredentials
from control_plane.xds.groups import EnvoyGroup, Role
from control_plane.xds.resources import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    LISTENER_TYPE,
    ROUTE_TYPE,
    resources_of,
)
from control_plane.xds.server import XdsServer
from control_plane.xds.snapshot import Snapshot
from control_plane.xds.stream import TypeState, nack_message
from control_plane.xds.stream_gate import StreamGate

QUIET_S = 0.3  # how long "nothing more is sent" is watched for
NACK_DETAIL = '[goo.gle/debugonly]Cluster {\n  name: "x"\n}\n: cluster x: bad weight'


OPERATOR = Actor("admin", "test")


@dataclass
class Fleetside:
    fleet: Fleet
    feed: ChangeFeed
    xds: XdsServer
    store: Store
    credentials: EnvoyCredentials
    token: str  # an xDS credential for INGRESS (us-east)

    def change(self) -> None:
        """Tell the server the fleet changed (what the summary publisher's feed does)."""
        self.feed.advance()


def xds_server(fleet: Fleet, feed: ChangeFeed, store: Store) -> XdsServer:
    """An ADS server whose credentials and refusals live in `store`."""
    refusals = RefusalAudit(store, RefusalLimits(max_per_address=100, max_total=1000))
    gate = StreamGate(EnvoyCredentials(store), refusals)
    return XdsServer(fleet, feed, 0.05, gate, lambda: None)


async def ingress_token(store: Store, region: str = "us-east") -> str:
    _, token = await EnvoyCredentials(store).mint(
        OPERATOR, f"ingress-{region}", Role.INGRESS, region
    )
    return token


@pytest_asyncio.fixture
async def side() -> AsyncIterator[Fleetside]:
    fleet = Fleet(unhealthy_after_s=60.0)
    add_region(fleet, "us-east")
    add_node(fleet, "a", port=9001, kv_blocks_free=300)
    add_node(fleet, "b", port=9002, kv_blocks_free=100)
    feed = ChangeFeed(1)
    store = open_store(":memory:")
    xds = xds_server(fleet, feed, store)
    await xds.start("127.0.0.1", 0)
    try:
        token = await ingress_token(store)
        yield Fleetside(fleet, feed, xds, store, EnvoyCredentials(store), token)
    finally:
        await xds.stop()
        feed.close()
        store.close()


@dataclass
class FakeEnvoy:
    """One ADS stream, driven by hand: requests in, responses collected in order."""

    channel: grpc.aio.Channel
    token: str | None  # its xDS credential (None: it sends none)
    group: EnvoyGroup = INGRESS
    node_id: str = "envoy-1"
    call: grpc.aio.StreamStreamCall | None = None
    responses: asyncio.Queue[discovery_pb2.DiscoveryResponse] = field(default_factory=asyncio.Queue)
    reader: asyncio.Task[None] | None = None
    is_first: bool = True
    names: dict[str, tuple[str, ...]] = field(default_factory=dict)  # last asked for, by type

    def open(self) -> None:
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(self.channel)
        metadata = () if self.token is None else (("authorization", f"Bearer {self.token}"),)
        self.call = stub.StreamAggregatedResources(metadata=metadata)
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.call is not None
        async for response in self.call:
            await self.responses.put(response)

    async def send(
        self,
        type_url: str,
        version: str = "",
        nonce: str = "",
        names: tuple[str, ...] | None = None,
        error: str | None = None,
    ) -> None:
        """A request; `names` default to the ones last asked for, as Envoy repeats them."""
        names = self.names.get(type_url, ()) if names is None else names
        self.names[type_url] = names
        request = discovery_pb2.DiscoveryRequest(
            type_url=type_url, version_info=version, response_nonce=nonce, resource_names=names
        )
        if self.is_first:  # like Envoy's set_node_on_first_message_only
            request.node.CopyFrom(base_pb2.Node(id=self.node_id))
            request.node.metadata.update(self.group.metadata())
            self.is_first = False
        if error is not None:
            request.error_detail.CopyFrom(status_pb2.Status(code=13, message=error))
        assert self.call is not None
        await self.call.write(request)

    async def receive(self, timeout_s: float = 2.0) -> discovery_pb2.DiscoveryResponse:
        return await asyncio.wait_for(self.responses.get(), timeout_s)

    async def ack(self, response: discovery_pb2.DiscoveryResponse) -> None:
        await self.send(response.type_url, response.version_info, response.nonce)

    async def assert_quiet(self) -> None:
        await asyncio.sleep(QUIET_S)
        assert self.responses.empty(), self.responses.get_nowait()

    async def subscribe_all(self) -> dict[str, discovery_pb2.DiscoveryResponse]:
        """Subscribe to the four types as Envoy does and ACK each first response."""
        first: dict[str, discovery_pb2.DiscoveryResponse] = {}
        for type_url, names in (
            (CLUSTER_TYPE, ()),
            (ENDPOINT_TYPE, ("meridian_us-east_nodes",)),
            (LISTENER_TYPE, ()),
            (ROUTE_TYPE, ("meridian_ingress_routes",)),
        ):
            await self.send(type_url, names=names)
            response = await self.receive()
            assert response.type_url == type_url
            await self.send(type_url, response.version_info, response.nonce, names)
            first[type_url] = response
        return first

    async def close(self) -> None:
        if self.call is not None:
            self.call.cancel()
        if self.reader is not None:
            self.reader.cancel()
            await asyncio.gather(self.reader, return_exceptions=True)


@pytest_asyncio.fixture
async def envoy(side: Fleetside) -> AsyncIterator[FakeEnvoy]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{side.xds.port}") as channel:
        fake = FakeEnvoy(channel, side.token)
        fake.open()
        try:
            yield fake
        finally:
            await fake.close()


def state_of(side: Fleetside, type_url: str) -> TypeState:
    (conn,) = side.xds.connections
    assert conn.state is not None
    return conn.state.types[type_url]


@pytest.mark.asyncio
async def test_first_request_is_answered_at_once_and_its_ack_recorded(
    side: Fleetside, envoy: FakeEnvoy
) -> None:
    await envoy.send(CLUSTER_TYPE)
    response = await envoy.receive()
    snapshot = side.xds.cache.get(INGRESS)
    assert snapshot is not None
    assert response.version_info == snapshot.get(CLUSTER_TYPE).version
    assert response.nonce and len(response.resources) == 1
    assert response.resources[0].type_url == CLUSTER_TYPE

    await envoy.ack(response)
    await envoy.assert_quiet()  # an ACK is answered by nothing, until something changes
    state = state_of(side, CLUSTER_TYPE)
    assert state.acked_version == response.version_info
    assert side.xds.counters.num_acks["clusters"] == 1
    assert side.xds.connections[0].ack_latency_ms[CLUSTER_TYPE] >= 0


@pytest.mark.asyncio
async def test_reconnecting_envoy_holding_the_current_version_is_answered(
    side: Fleetside, envoy: FakeEnvoy
) -> None:
    snapshot = side.xds.cache.get(INGRESS) or side.xds._snapshot_for(INGRESS)
    assert snapshot is not None
    version = snapshot.get(LISTENER_TYPE).version
    await envoy.send(LISTENER_TYPE, version=version)  # no nonce: a new stream
    response = await envoy.receive()
    assert response.version_info == version and len(response.resources) == 1


@pytest.mark.asyncio
async def test_capacity_change_pushes_only_endpoints(side: Fleetside, envoy: FakeEnvoy) -> None:
    first = await envoy.subscribe_all()
    await envoy.assert_quiet()  # refresh ticks with an unchanged fleet push nothing

    add_node(side.fleet, "a", port=9001, kv_blocks_free=100)  # a beat with new numbers
    response = await envoy.receive(1.0)  # by the periodic refresh, no feed move needed
    assert response.type_url == ENDPOINT_TYPE
    assert response.version_info != first[ENDPOINT_TYPE].version_info
    await envoy.ack(response)
    await envoy.assert_quiet()


@pytest.mark.asyncio
async def test_responses_go_out_in_envoys_order(side: Fleetside, envoy: FakeEnvoy) -> None:
    await envoy.subscribe_all()
    # Every type changes at once (a new listener port, cluster, routes and endpoints).
    moved = EnvoyGroup(INGRESS.role, INGRESS.region, "127.0.0.1", 10999)
    resources = resources_of(two_node_plan(moved, weight_b=50))
    resources[CLUSTER_TYPE][0].connect_timeout.seconds = 2
    resources[ROUTE_TYPE][0].virtual_hosts[0].domains.append("example.test")
    assert side.xds.cache.set_snapshot(INGRESS, Snapshot.of(resources))
    order = [(await envoy.receive()).type_url for _ in range(4)]
    assert order == [CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE]


@pytest.mark.asyncio
async def test_nack_is_counted_and_the_version_not_sent_again(
    side: Fleetside, envoy: FakeEnvoy
) -> None:
    first = await envoy.subscribe_all()
    good = first[ENDPOINT_TYPE]
    add_node(side.fleet, "b", port=9002, kv_blocks_free=300)
    side.change()
    pushed = await envoy.receive()
    assert pushed.type_url == ENDPOINT_TYPE
    # Envoy rejects it: the version it keeps, the nonce it answers, and why.
    names = ("meridian_us-east_nodes",)
    await envoy.send(ENDPOINT_TYPE, good.version_info, pushed.nonce, names, NACK_DETAIL)
    await envoy.assert_quiet()  # no resend loop, even across refresh ticks
    side.change()
    await envoy.assert_quiet()  # a feed move with the same snapshot changes nothing

    state = state_of(side, ENDPOINT_TYPE)
    assert state.num_nacks == 1
    assert state.last_error == "cluster x: bad weight"
    assert state.acked_version == good.version_info
    assert side.xds.counters.num_nacks["endpoints"] == 1

    # A new version is sent (and accepted).
    add_node(side.fleet, "b", port=9002, kv_blocks_free=900)
    side.change()
    fresh = await envoy.receive()
    assert fresh.version_info not in (good.version_info, pushed.version_info)
    await envoy.ack(fresh)
    assert (await side.xds.wait_for_ack("us-east", fresh.version_info, 1.0)).is_complete


@pytest.mark.asyncio
async def test_stale_nonces_are_ignored(side: Fleetside, envoy: FakeEnvoy) -> None:
    await envoy.send(CLUSTER_TYPE)
    response = await envoy.receive()
    await envoy.send(CLUSTER_TYPE, "old-version", "not-a-nonce-we-sent")
    await envoy.assert_quiet()
    assert side.xds.counters.num_stale["clusters"] == 1
    assert state_of(side, CLUSTER_TYPE).is_reply_pending
    await envoy.ack(response)
    waited = await side.xds.wait_for_ack("us-east", response.version_info, 1.0, CLUSTER_TYPE)
    assert waited.is_complete and side.xds.counters.num_acks["clusters"] == 1


@pytest.mark.asyncio
async def test_rerequest_with_an_acked_nonce_is_answered(side: Fleetside, envoy: FakeEnvoy) -> None:
    """After a Cluster changes, Envoy asks for its endpoints again with the same version and
    nonce; left unanswered, the cluster would stay warming for 15 s."""
    names = ("meridian_us-east_nodes",)
    await envoy.send(ENDPOINT_TYPE, names=names)
    first = await envoy.receive()
    await envoy.send(ENDPOINT_TYPE, first.version_info, first.nonce, names)  # the ACK
    await envoy.assert_quiet()
    await envoy.send(ENDPOINT_TYPE, first.version_info, first.nonce, names)  # asking again
    again = await envoy.receive()
    assert again.version_info == first.version_info and again.nonce != first.nonce
    assert len(again.resources) == 1


@pytest.mark.asyncio
async def test_endpoints_follow_the_requested_names(side: Fleetside, envoy: FakeEnvoy) -> None:
    await envoy.send(ENDPOINT_TYPE, names=("no-such-cluster",))
    empty = await envoy.receive()
    assert list(empty.resources) == []
    # The ACK comes with new names (a new cluster appeared): answered with those.
    names = ("meridian_us-east_nodes",)
    await envoy.send(ENDPOINT_TYPE, empty.version_info, empty.nonce, names)
    named = await envoy.receive()
    assert len(named.resources) == 1


@pytest.mark.asyncio
async def test_stream_without_meridian_metadata_is_refused(side: Fleetside) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{side.xds.port}") as channel:
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
        metadata = (("authorization", f"Bearer {side.token}"),)
        call = stub.StreamAggregatedResources(metadata=metadata)
        request = discovery_pb2.DiscoveryRequest(type_url=CLUSTER_TYPE)
        request.node.id = "stranger"
        await call.write(request)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await asyncio.wait_for(call.read(), 2.0)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "envoy-bootstrap" in (caught.value.details() or "")
    assert side.xds.counters.num_refused_streams == 1 and side.xds.connections == []


@pytest.mark.asyncio
async def test_invalid_snapshot_is_held_back(
    side: Fleetside, envoy: FakeEnvoy, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = await envoy.subscribe_all()
    zero = two_node_plan(weight_b=0)
    monkeypatch.setattr(server_module, "plan_for", lambda *args: zero)
    side.change()
    await envoy.assert_quiet()
    assert side.xds.counters.num_invalid_snapshots == 1
    snapshot = side.xds.cache.get(INGRESS)
    assert snapshot is not None
    assert snapshot.get(ENDPOINT_TYPE).version == first[ENDPOINT_TYPE].version_info


@pytest.mark.asyncio
async def test_wait_for_ack_waits_for_every_envoy_of_the_region(
    side: Fleetside, envoy: FakeEnvoy
) -> None:
    first = await envoy.subscribe_all()
    version = first[ENDPOINT_TYPE].version_info
    assert (await side.xds.wait_for_ack("us-east", version, 0.1)).is_complete
    # Another region's drain does not wait for this Envoy.
    assert (await side.xds.wait_for_ack("eu-west", "nope", 0.1)).num_envoys == 0

    side.fleet.nodes["b"].drain_requested = True
    side.change()
    waiting = asyncio.create_task(
        side.xds.wait_for_ack("us-east", lacks_endpoint("http://127.0.0.1:9002"), 2.0)
    )
    pushed = await envoy.receive()
    await asyncio.sleep(0.05)
    assert not waiting.done()  # sent, not yet ACKed
    await envoy.ack(pushed)
    done = await waiting
    assert done.is_complete and done.num_envoys == 1

    timed_out = await side.xds.wait_for_ack("us-east", "some-other-version", 0.1)
    assert not timed_out.is_complete and timed_out.lagging == ("envoy-1",)


def test_nack_message_is_the_text_after_the_proto_dump() -> None:
    assert nack_message(NACK_DETAIL) == "cluster x: bad weight"
    assert nack_message("plain\nmessage  ") == "plain message"
