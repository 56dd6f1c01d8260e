"""Consul discovery merged with heartbeats, through `py-consul`, against the Consul STAND-IN
(tests/consul_standin.py) — or against a real agent when CONSUL_HTTP_ADDR is set, in which case
the stand-in is not started and every test uses its own service name."""

from __future__ import annotations

import asyncio
import os
import secrets
import time
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import consul.aio
import pytest
import pytest_asyncio
from conftest import ControlPlaneClient, eventually, heartbeat, make_settings
from consul_standin import ConsulTarget, consul_address

from control_plane.consul_sync import ConsulSync, aggregate_status, entry_of, parse_consul_addr
from control_plane.model import ConsulEntry, ConsulStatus, Fleet, Node, NodeIdentity
from control_plane.settings import Settings
from control_plane.tokens import TokenSet

MAX_WAIT_S = 5.0


# In test ids: which Consul the test ran against.
CONSUL_KIND = "real-consul" if os.environ.get("CONSUL_HTTP_ADDR") else "consul-standin"


@pytest_asyncio.fixture(params=[CONSUL_KIND])
async def consul_target() -> AsyncIterator[ConsulTarget]:
    """The stand-in on this test's event loop, or the real agent at CONSUL_HTTP_ADDR."""
    async with consul_address() as target:
        yield target


@pytest.fixture
def service_name() -> str:
    return f"meridian-node-test-{secrets.token_hex(4)}"


@pytest.fixture
def settings(
    tmp_path: Path, tokens: TokenSet, consul_target: ConsulTarget, service_name: str
) -> Settings:
    return make_settings(
        tmp_path / "cp.db",
        tokens,
        heartbeat_interval_s=5.0,
        dns={"ttl_s": 1},  # the drain sequence waits one TTL
        consul_addr=consul_target.addr,
        consul_service_name=service_name,
    )


class NodeAgents:
    """Plays the node agents' part in Consul through py-consul, as node_agent/consul.py does."""

    def __init__(self, client: consul.aio.Consul, service_name: str) -> None:
        self.client = client
        self.service_name = service_name
        self.registered: set[str] = set()

    async def register(
        self,
        node_id: str,
        status: str = "passing",
        ttl: str = "30s",
        url: str = "http://127.0.0.1:9101",
    ) -> None:
        meta = {
            "node_id": node_id,
            "region": "us-east",
            "model": "smollm2-135m-instruct",
            "tp_size": "1",
            "url": url,
        }
        check = {"CheckID": f"service:{node_id}", "Name": "heartbeat", "TTL": ttl, "Status": status}
        await self.client.agent.service.register(
            self.service_name,
            service_id=node_id,
            address="127.0.0.1",
            port=9101,
            meta=meta,
            check=check,
        )
        self.registered.add(node_id)

    async def deregister(self, node_id: str) -> None:
        await self.client.agent.service.deregister(node_id)
        self.registered.discard(node_id)


@pytest_asyncio.fixture
async def agents(consul_target: ConsulTarget, service_name: str) -> AsyncIterator[NodeAgents]:
    scheme, host, port = parse_consul_addr(consul_target.addr)
    with warnings.catch_warnings():  # py-consul passes aiohttp a deprecated argument
        warnings.simplefilter("ignore", DeprecationWarning)
        client = consul.aio.Consul(host=host, port=port, scheme=scheme, connections_timeout=15)
    agents = NodeAgents(client, service_name)
    try:
        yield agents
    finally:
        if consul_target.standin is None or consul_target.standin.is_running:
            for node_id in list(agents.registered):
                await agents.deregister(node_id)
        await client.close()


async def node_view(cp: ControlPlaneClient, node_id: str) -> dict[str, Any] | None:
    response = await cp.http.get(f"/v1/nodes/{node_id}", headers=cp.admin)
    return response.json() if response.status_code == 200 else None


async def summary_healthy(cp: ControlPlaneClient, region: str) -> int:
    response = await cp.http.get("/v1/regions/summary", headers=cp.gateway)
    regions = {r["name"]: r for r in response.json()["regions"]}
    return int(regions[region]["healthy_nodes"])


@pytest.mark.asyncio
async def test_node_registered_in_consul_appears_with_its_source_and_goes_on_deregister(
    cp: ControlPlaneClient, agents: NodeAgents
) -> None:
    await cp.add_region("us-east")
    await agents.register("c1")

    async def is_listed_healthy() -> bool:
        view = await node_view(cp, "c1")
        return view is not None and view["is_healthy"]

    await eventually(is_listed_healthy)
    view = await node_view(cp, "c1")
    assert view is not None
    assert view["sources"] == ["consul"] and view["consul_status"] == "passing"
    assert view["region"] == "us-east" and view["url"] == "http://127.0.0.1:9101"
    assert view["last_heartbeat"] is None
    assert await summary_healthy(cp, "us-east") == 1

    # A failing check takes it out of routing; passing again brings it back.
    await agents.client.agent.check.ttl_fail("service:c1", notes="draining")

    async def is_unhealthy() -> bool:
        view = await node_view(cp, "c1")
        return view is not None and not view["is_healthy"]

    await eventually(is_unhealthy)
    assert (await node_view(cp, "c1") or {})["consul_status"] == "critical"
    assert await summary_healthy(cp, "us-east") == 0

    # Operators cannot drain or delete what only Consul knows: it says where to do it.
    drain = await cp.http.post("/v1/nodes/c1/drain", headers=cp.admin)
    assert drain.status_code == 409 and drain.json()["error"]["code"] == "node_in_consul"
    assert (await cp.http.delete("/v1/nodes/c1", headers=cp.admin)).status_code == 409

    await agents.deregister("c1")

    async def is_gone() -> bool:
        return await node_view(cp, "c1") is None

    await eventually(is_gone)


@pytest.mark.asyncio
async def test_heartbeats_and_consul_merge_into_one_node(
    cp: ControlPlaneClient, agents: NodeAgents
) -> None:
    await cp.add_region("us-east")
    await cp.beat("n1")
    await agents.register("n1")

    async def has_both_sources() -> bool:
        view = await node_view(cp, "n1")
        return view is not None and view["sources"] == ["heartbeat", "consul"]

    await eventually(has_both_sources)
    assert (await node_view(cp, "n1") or {})["is_healthy"] is True

    # Consul's critical is a veto, even while the node beats.
    await agents.client.agent.check.ttl_fail("service:n1")

    async def is_vetoed() -> bool:
        await cp.beat("n1")
        view = await node_view(cp, "n1")
        return view is not None and not view["is_healthy"]

    await eventually(is_vetoed)

    # Deregistered from Consul: a node that heartbeats stays, and the veto goes with it.
    await agents.deregister("n1")

    async def is_heartbeat_only() -> bool:
        view = await node_view(cp, "n1")
        return view is not None and view["sources"] == ["heartbeat"] and view["is_healthy"]

    await eventually(is_heartbeat_only)


@pytest.mark.asyncio
async def test_consul_only_node_that_starts_beating_becomes_a_heartbeat_node(
    cp: ControlPlaneClient, agents: NodeAgents
) -> None:
    await cp.add_region("us-east")
    await agents.register("n2")

    async def is_listed() -> bool:
        return await node_view(cp, "n2") is not None

    await eventually(is_listed)
    await cp.beat("n2")
    view = await node_view(cp, "n2")
    assert view is not None and view["sources"] == ["heartbeat", "consul"]
    assert view["url"] == heartbeat("n2")["url"] != "http://127.0.0.1:9101"  # its own URL wins
    # It is now in the store: an operator may drain it.
    assert (await cp.http.post("/v1/nodes/n2/drain", headers=cp.admin)).status_code == 200


async def drain_of(cp: ControlPlaneClient, node_id: str) -> dict[str, Any] | None:
    view = await node_view(cp, node_id)
    return view["drain"] if view is not None else None


@pytest.mark.slow  # seconds of waiting on timeouts
@pytest.mark.asyncio
async def test_drain_waits_for_the_node_to_leave_consul(
    cp: ControlPlaneClient, agents: NodeAgents
) -> None:
    await cp.add_region("us-east")
    await cp.beat("n4")
    await agents.register("n4")

    async def is_in_consul() -> bool:
        return ((await node_view(cp, "n4")) or {}).get("sources") == ["heartbeat", "consul"]

    await eventually(is_in_consul)
    assert (await cp.http.post("/v1/nodes/n4/drain", headers=cp.admin)).status_code == 200
    await cp.beat("n4", draining=True, num_running=0, num_waiting=0)

    async def is_at_consul() -> bool:
        return ((await drain_of(cp, "n4")) or {}).get("phase") == "consul"

    await eventually(is_at_consul)
    # The node agent's part: told to leave Consul, it deregisters itself (and is not told to exit).
    reply = await cp.beat("n4", draining=True, num_running=0, num_waiting=0)
    assert (reply["consul_deregister"], reply["may_exit"]) == (True, False)
    await agents.deregister("n4")

    async def may_exit() -> bool:
        return ((await drain_of(cp, "n4")) or {}).get("phase") == "exit"

    await eventually(may_exit)
    drain = await drain_of(cp, "n4")
    assert drain is not None and drain["steps"][4]["note"] == "out of Consul"
    assert (await cp.beat("n4", draining=True, num_running=0, num_waiting=0))["may_exit"] is True


@pytest.mark.slow  # seconds of waiting on timeouts
@pytest.mark.asyncio
async def test_region_drain_deregisters_consul_only_nodes_itself(
    cp: ControlPlaneClient, agents: NodeAgents
) -> None:
    await cp.add_region("us-east")
    await agents.register("c5")

    async def is_listed() -> bool:
        return await node_view(cp, "c5") is not None

    await eventually(is_listed)
    patched = await cp.http.patch(
        "/v1/regions/us-east", json={"state": "draining"}, headers=cp.admin
    )
    assert patched.status_code == 200
    # Nothing to tell a node known only from Consul: the control plane deregisters it there.

    async def is_gone() -> bool:
        return await node_view(cp, "c5") is None

    await eventually(is_gone)
    agents.registered.discard("c5")
    _, items = await agents.client.health.service(agents.service_name)
    assert items == []
    await cp.services.drain_loop.step()  # the sequence of a node that is gone is forgotten
    entries = (await cp.http.get("/v1/audit", headers=cp.admin)).json()["entries"]
    steps = [e["detail"].get("step") for e in entries if e["target"] == "c5"]
    assert steps[:5] == [None, "admissions", "envoy", "summaries", "dns"]  # start, then steps
    assert entries[-1]["action"] == "drain.forget" and entries[-1]["detail"] == {"phase": "consul"}


@pytest.mark.asyncio
async def test_blocking_query_wakes_on_change_and_times_out_without(agents: NodeAgents) -> None:
    index, items = await agents.client.health.service(agents.service_name)
    assert items == []
    started = time.monotonic()
    same, _ = await agents.client.health.service(agents.service_name, index=index, wait="500ms")
    waited_s = time.monotonic() - started
    assert same == index and 0.4 <= waited_s < 3.0  # (a real agent adds up to wait/16 jitter)

    waiter = asyncio.create_task(
        agents.client.health.service(agents.service_name, index=index, wait="20s")
    )
    await asyncio.sleep(0.2)
    assert not waiter.done()
    changed_at = time.monotonic()
    await agents.register("w1")
    new_index, items = await asyncio.wait_for(waiter, MAX_WAIT_S)
    assert time.monotonic() - changed_at < 1.0
    assert int(new_index) > int(index) and [i["Service"]["ID"] for i in items] == ["w1"]
    assert aggregate_status(items[0]["Checks"]) == "passing"


@pytest.mark.asyncio
async def test_ttl_check_not_renewed_turns_critical(agents: NodeAgents) -> None:
    await agents.register("t1", ttl="1s")
    index, items = await agents.client.health.service(agents.service_name)
    assert aggregate_status(items[0]["Checks"]) == "passing"
    deadline = time.monotonic() + MAX_WAIT_S
    while aggregate_status(items[0]["Checks"]) != "critical":
        assert time.monotonic() < deadline, "TTL check never expired"
        index, items = await agents.client.health.service(
            agents.service_name, index=index, wait="5s"
        )
    assert any("TTL expired" in c["Output"] for c in items[0]["Checks"])


@pytest.mark.asyncio
async def test_unreachable_consul_makes_its_statuses_unknown(
    consul_target: ConsulTarget, agents: NodeAgents
) -> None:
    if not consul_target.is_standin:
        pytest.skip("stops the Consul it talks to: stand-in only")
    assert consul_target.standin is not None
    await agents.register("u1")
    views: list[dict[str, ConsulEntry]] = []
    sync = ConsulSync(consul_target.addr, agents.service_name, views.append, stale_after_s=0.3)
    task = asyncio.create_task(sync.run())
    try:

        async def has_read() -> bool:
            return bool(views)

        await eventually(has_read)
        assert views[-1]["u1"].status == "passing"
        await consul_target.standin.stop()

        async def is_unknown() -> bool:
            return views[-1]["u1"].status == "unknown"

        await eventually(is_unknown)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_entries_are_read_from_service_meta_and_checks() -> None:
    item = {
        "Node": {"Address": "10.1.2.3"},
        "Service": {
            "ID": "svc-7",
            "Address": "",
            "Port": 9007,
            "Meta": {"region": "eu-west", "model": "m", "node_id": "n7", "tp_size": "2"},
        },
        "Checks": [{"Status": "passing"}, {"Status": "warning"}],
    }
    node_id, entry = entry_of(item)
    assert node_id == "n7"
    assert entry == ConsulEntry(NodeIdentity("eu-west", "http://10.1.2.3:9007", "m", 2), "warning")
    assert aggregate_status([{"Status": "passing"}, {"Status": "critical"}]) == "critical"
    assert aggregate_status([]) == "passing"
    item["Service"]["Meta"] = {"model": "m"}  # type: ignore[index]
    with pytest.raises(ValueError, match="region"):
        entry_of(item)


def test_merge_rule_of_heartbeats_and_consul() -> None:
    identity = NodeIdentity("us-east", "http://127.0.0.1:9101", "m", 1)
    fleet = Fleet(unhealthy_after_s=3.0)

    def apply(**statuses: ConsulStatus) -> bool:
        return fleet.apply_consul({n: ConsulEntry(identity, s) for n, s in statuses.items()}, 0.0)

    # Consul-only: healthy while its checks pass (warning counts as passing).
    assert apply(c1="passing") and fleet.nodes["c1"].is_healthy
    assert fleet.nodes["c1"].sources == ["consul"]
    assert not apply(c1="warning") and fleet.nodes["c1"].is_healthy
    assert apply(c1="critical") and not fleet.nodes["c1"].is_healthy
    assert apply(c1="unknown") is False and not fleet.nodes["c1"].is_healthy
    # A heartbeat node: its beats decide, Consul can only veto.
    fleet.nodes["h1"] = Node("h1", identity, drain_requested=False, registered_at=0.0)
    fleet.nodes["h1"].is_beating = True
    for status, is_healthy in (("passing", True), ("critical", False), ("unknown", True)):
        apply(c1="passing", h1=status)
        assert fleet.nodes["h1"].is_healthy is is_healthy, status
        assert fleet.nodes["h1"].sources == ["heartbeat", "consul"]
    fleet.nodes["h1"].is_beating = False
    apply(c1="passing", h1="passing")
    assert not fleet.nodes["h1"].is_healthy  # passing in Consul, silent to us: unhealthy
    # Gone from Consul: the Consul-only node is forgotten, the heartbeat node stays.
    assert apply()
    assert list(fleet.nodes) == ["h1"] and fleet.nodes["h1"].sources == ["heartbeat"]
