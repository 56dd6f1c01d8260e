"""Who may open an ADS stream: a raw gRPC client (grpcio and xds-protos, as any prober would use)
without a credential, with an unknown one, or with one for another region or role is refused and
sent nothing; a credential that is replaced or deleted closes the streams that hold it."""

from __future__ import annotations

import asyncio
from unittest.mock import ANY

import grpc
import pytest
from conftest import eventually
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from test_xds_plan import INGRESS
from test_xds_server import OPERATOR, FakeEnvoy, Fleetside, ingress_token, side

from control_plane import audit
from control_plane.xds.groups import EnvoyGroup, Role
from control_plane.xds.resources import CLUSTER_TYPE

__all__ = ["side"]  # the fixture, used by name

EU_WEST = EnvoyGroup(Role.INGRESS, "eu-west", "127.0.0.1", 10001)
EDGE = EnvoyGroup(Role.EDGE, None, "127.0.0.1", 10002)


async def ask_for_everything(
    side: Fleetside,
    metadata: tuple[tuple[str, str], ...],
    group: EnvoyGroup | None = INGRESS,
) -> tuple[grpc.StatusCode, str, list[discovery_pb2.DiscoveryResponse]]:
    """One stream that asks for clusters as `group` with a made-up node id (None: that sends
    nothing, only its metadata): how it ended, and what it was sent before. One request at most:
    the server may end the stream as soon as it has read it, and a write after that fails on the
    client's side, which then reports its own INTERNAL instead of the server's status. A stream
    refused on its metadata alone may end before even that one is written, so those are asked
    with none."""
    received: list[discovery_pb2.DiscoveryResponse] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{side.xds.port}") as channel:
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
        call = stub.StreamAggregatedResources(metadata=metadata)
        if group is not None:
            request = discovery_pb2.DiscoveryRequest(type_url=CLUSTER_TYPE)
            request.node.id = "made-up-node"
            request.node.metadata.update(group.metadata())
            await call.write(request)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async with asyncio.timeout(5.0):
                async for response in call:
                    received.append(response)
    return caught.value.code(), caught.value.details() or "", received


def refusals(side: Fleetside) -> list[audit.AuditEntry]:
    entries = side.store.read_sync(lambda conn: audit.list_entries(conn, 0, 100))
    return [e for e in entries if e.action == "auth.refused"]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("metadata", "code"),
    [
        ((), "missing_api_key"),
        ((("authorization", "Bearer mxds-made-up-token-0123456789"),), "invalid_api_key"),
        ((("authorization", "Basic YWRtaW46YWRtaW4="),), "invalid_api_key"),
    ],
)
async def test_a_stream_without_a_valid_credential_gets_nothing(
    side: Fleetside, metadata: tuple[tuple[str, str], ...], code: str
) -> None:
    status, details, received = await ask_for_everything(side, metadata, group=None)
    assert status == grpc.StatusCode.UNAUTHENTICATED and "/v1/xds/credentials" in details
    assert received == []
    assert side.xds.connections == [] and side.xds.counters.num_refused_streams == 1
    assert side.xds.cache.watched_groups() == []  # it never even asked for a snapshot
    (entry,) = refusals(side)
    assert (entry.actor, entry.target, entry.detail["status"]) == ("anonymous", "xds", 401)
    assert entry.detail["code"] == code and entry.client.startswith("ipv4:127.0.0.1:")


@pytest.mark.asyncio
@pytest.mark.parametrize("group", [EU_WEST, EDGE])
async def test_a_credential_asks_only_for_its_own_region_and_role(
    side: Fleetside, group: EnvoyGroup
) -> None:
    metadata = (("authorization", f"Bearer {side.token}"),)  # minted for the us-east ingress
    status, details, received = await ask_for_everything(side, metadata, group)
    assert status == grpc.StatusCode.PERMISSION_DENIED
    assert f"is for ingress/us-east, not {group.label}" in details
    assert received == [] and side.xds.connections == []
    (entry,) = refusals(side)
    assert (entry.actor, entry.detail["status"], entry.detail["code"]) == (
        "envoy",
        403,
        "credential_mismatch",
    )
    assert "made-up-node" in entry.client


@pytest.mark.asyncio
async def test_each_credential_gets_its_own_groups_snapshot(side: Fleetside) -> None:
    _, edge_token = await side.credentials.mint(OPERATOR, "edge", Role.EDGE, None)
    eu_token = await ingress_token(side.store, "eu-west")
    for token, group in ((side.token, INGRESS), (edge_token, EDGE), (eu_token, EU_WEST)):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{side.xds.port}") as channel:
            envoy = FakeEnvoy(channel, token, group=group)
            envoy.open()
            await envoy.send(CLUSTER_TYPE)
            response = await envoy.receive()
            assert response.type_url == CLUSTER_TYPE and len(response.resources) == 1
            await envoy.close()
    assert refusals(side) == []


@pytest.mark.asyncio
@pytest.mark.parametrize("revoke", ["replace", "delete"])
async def test_replacing_or_deleting_a_credential_closes_its_streams(
    side: Fleetside, revoke: str
) -> None:
    _, edge_token = await side.credentials.mint(OPERATOR, "edge", Role.EDGE, None)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{side.xds.port}") as channel:
        revoked, kept = FakeEnvoy(channel, side.token), FakeEnvoy(channel, edge_token, group=EDGE)
        for envoy in (revoked, kept):
            envoy.open()
            await envoy.send(CLUSTER_TYPE)
            await envoy.ack(await envoy.receive())
        assert len(side.xds.connections) == 2
        if revoke == "replace":
            await side.credentials.mint(OPERATOR, "ingress-us-east", Role.INGRESS, "us-east")
        else:
            await side.credentials.delete(OPERATOR, "ingress-us-east")
        assert await side.xds.recheck() == 1
        assert revoked.reader is not None
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await asyncio.wait_for(revoked.reader, 5.0)  # its stream ends
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "'ingress-us-east' was replaced or deleted" in (caught.value.details() or "")

        async def one_left() -> bool:  # the server forgets the stream after the client saw it end
            return len(side.xds.connections) == 1

        await eventually(one_left)
        [left] = side.xds.connections
        assert left.group == EDGE
        await kept.close()
    history = side.store.read_sync(lambda conn: audit.list_entries(conn, 0, 100))
    last = [e for e in history if e.action.startswith("xds.credential")][-1]
    assert last.target == "ingress-us-east" and last.actor == "admin"
    assert last.detail["old"] == {"role": "ingress", "region": "us-east", "created_at": ANY}
