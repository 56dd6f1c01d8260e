"""Heartbeat ingestion: validation, the reply, drain, and health judged by missed beats."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import pytest
from conftest import ControlPlaneClient, heartbeat, settings_on_each_db

from control_plane.api.fast_heartbeat import HeartbeatFastPath
from wire.heartbeat import Heartbeat, HeartbeatReply
from wire.region_summary import RegionSummaryIndex

settings = pytest.fixture(settings_on_each_db)  # every test on SQLite and PostgreSQL


async def summary(cp: ControlPlaneClient, **params: Any) -> RegionSummaryIndex:
    response = await cp.http.get("/v1/regions/summary", params=params, headers=cp.gateway)
    assert response.status_code == 200, response.text
    document = RegionSummaryIndex.model_validate_json(response.content)
    assert int(response.headers["x-meridian-index"]) == document.index
    return document


@pytest.mark.asyncio
async def test_heartbeat_registers_node_and_fills_the_summary(cp: ControlPlaneClient) -> None:
    await cp.add_region("us-east")
    reply = HeartbeatReply.model_validate(await cp.beat("n1", kv_blocks_free=600))
    assert reply == HeartbeatReply(drain=False, heartbeat_interval_s=0.2, region_registered=True)
    await cp.beat(
        "n2",
        kv_blocks_free=100,
        num_waiting=1,
        num_waiting_prefill_tokens=100,
        num_running_prefill_tokens=700,
    )

    (region,) = (await summary(cp)).regions
    assert region.name == "us-east" and region.healthy_nodes == 2
    assert (region.kv_blocks_free, region.kv_blocks_total) == (700, 2000)
    assert region.queue.num_waiting == 3 and region.queue.num_waiting_prefill_tokens == 500
    assert region.queue.num_running_prefill_tokens == 700  # n1 (an older agent) reports none
    assert region.queue.decode_tokens_per_s == 400.0
    assert region.queue.expected_queue_delay_s == pytest.approx(500 / 400)

    nodes = (await cp.http.get("/v1/nodes", headers=cp.admin)).json()["nodes"]
    assert [(n["node_id"], n["is_healthy"]) for n in nodes] == [("n1", True), ("n2", True)]
    assert nodes[0]["last_heartbeat"]["kv_blocks_free"] == 600


@pytest.mark.asyncio
async def test_unknown_fields_are_ignored(cp: ControlPlaneClient) -> None:
    body = heartbeat("n1") | {"gpu_temperature_c": 71, "future": {"nested": [1, 2]}}
    headers = await cp.node_headers("n1")
    response = await cp.http.post("/v1/nodes/heartbeat", json=body, headers=headers)
    assert response.status_code == 200, response.text
    node = (await cp.http.get("/v1/nodes/n1", headers=cp.admin)).json()
    assert "gpu_temperature_c" not in node["last_heartbeat"]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"kv_blocks_free": 1001}, "kv_blocks_free must not exceed"),
        ({"kv_blocks_free": -1}, "kv_blocks_free"),
        ({"num_waiting": -3}, "num_waiting"),
        ({"decode_tokens_per_s": -0.5}, "decode_tokens_per_s"),
        ({"block_size": 0}, "block_size"),
        ({"tp_size": 0}, "tp_size"),
        ({"url": "ftp://127.0.0.1:9001"}, "url"),
        ({"url": "127.0.0.1:9001"}, "url"),
        ({"node_id": "Bad Node"}, "node_id"),
        ({"region": ""}, "region"),
        ({"schema_version": 2}, "schema_version"),
        ({"draining": "maybe"}, "draining"),
        ({"timestamp": None}, "timestamp"),
    ],
)
async def test_bad_heartbeat_is_422(
    cp: ControlPlaneClient, change: dict[str, Any], fragment: str
) -> None:
    body = heartbeat("n1") | change
    headers = await cp.node_headers("n1")
    response = await cp.http.post("/v1/nodes/heartbeat", json=body, headers=headers)
    assert response.status_code == 422, response.text
    assert fragment in response.json()["error"]["message"]
    assert (await cp.http.get("/v1/nodes", headers=cp.admin)).json()["nodes"] == []


def test_heartbeat_model_requires_the_contract_fields() -> None:
    body = heartbeat("n1")
    for name in ("node_id", "region", "url", "model", "kv_blocks_total", "block_size"):
        with pytest.raises(ValueError, match=name):
            Heartbeat.model_validate({k: v for k, v in body.items() if k != name})
    assert Heartbeat.model_validate(body | {"extra": 1}).node_id == "n1"


@pytest.mark.asyncio
async def test_drain_is_told_to_the_node_and_takes_it_out(cp: ControlPlaneClient) -> None:
    await cp.add_region("us-east")
    await cp.beat("n1")
    await cp.beat("n2")
    drained = await cp.http.post("/v1/nodes/n1/drain", headers=cp.admin)
    assert drained.status_code == 200 and drained.json()["drain_requested"] is True
    assert drained.json()["drain"]["phase"] == "admissions"
    # Step 1: the node is told, and stays in routing until it says it stopped admitting.
    reply = await cp.beat("n1")
    assert (reply["drain"], reply["drain_phase"], reply["may_exit"]) == (True, "admissions", False)
    assert (await cp.beat("n2"))["drain"] is False
    assert (await summary(cp)).regions[0].healthy_nodes == 2
    await cp.beat("n1", draining=True)
    await cp.services.drain_loop.step()  # no Envoy connected: EDS at once, then the summaries
    assert (await summary(cp)).regions[0].healthy_nodes == 1

    undrained = await cp.http.post("/v1/nodes/n1/undrain", headers=cp.admin)
    assert undrained.json()["drain_requested"] is False and undrained.json()["drain"] is None
    assert (await cp.beat("n1", draining=True))["drain"] is False  # made before it heard
    assert (await summary(cp)).regions[0].healthy_nodes == 2
    await cp.services.drain_loop.step()
    assert cp.services.drains.sequences == {}  # that `draining` echoed ours: not a new drain
    await cp.beat("n1", draining=False)
    node = (await cp.http.get("/v1/nodes/n1", headers=cp.admin)).json()
    assert node["is_draining"] is False

    # A node draining on its own (SIGTERM at the agent) leaves routing too.
    await cp.beat("n2", draining=True)
    await cp.services.drain_loop.step()
    assert (await summary(cp)).regions[0].healthy_nodes == 1
    assert cp.services.drains.sequences["n2"].reason == "node"
    for path in ("/v1/nodes/zz/drain", "/v1/nodes/zz/undrain"):
        assert (await cp.http.post(path, headers=cp.admin)).status_code == 404


@pytest.mark.slow  # seconds of waiting on timeouts
@pytest.mark.asyncio
async def test_node_missing_three_beats_is_unhealthy_and_leaves_the_summary(
    cp: ControlPlaneClient,
) -> None:
    await cp.add_region("us-east")
    await cp.beat("n1")
    await cp.beat("n2")
    assert (await summary(cp)).regions[0].healthy_nodes == 2
    # Keep n2 beating every 0.1 s; n1 goes silent. Unhealthy after 3 × 0.2 s.
    deadline = time.monotonic() + 1.2
    while time.monotonic() < deadline:
        await cp.beat("n2")
        await asyncio.sleep(0.1)
    region = (await summary(cp)).regions[0]
    assert region.healthy_nodes == 1 and region.kv_blocks_total == 1000
    nodes = {
        n["node_id"]: n for n in (await cp.http.get("/v1/nodes", headers=cp.admin)).json()["nodes"]
    }
    assert nodes["n1"]["is_healthy"] is False and nodes["n2"]["is_healthy"] is True
    # One beat brings it back at once.
    await cp.beat("n1")
    assert (await summary(cp)).regions[0].healthy_nodes == 2


@pytest.mark.asyncio
async def test_node_of_unregistered_region_is_known_but_not_routed(cp: ControlPlaneClient) -> None:
    reply = await cp.beat("n1", region="ap-south")
    assert reply["region_registered"] is False
    assert (await summary(cp)).regions == []
    status = (await cp.http.get("/v1/status", headers=cp.admin)).json()
    assert status["unregistered_regions"] == ["ap-south"] and status["num_nodes"] == 1

    async def keep_beating() -> None:
        # A live node beats on: a slow store must not let it lapse (3 x 0.2 s) meanwhile.
        while True:
            await cp.beat("n1", region="ap-south")
            await asyncio.sleep(0.1)

    beating = asyncio.create_task(keep_beating())
    try:
        await cp.add_region("ap-south", lat=19.1, lon=72.9)
        assert (await summary(cp)).regions[0].healthy_nodes == 1
    finally:
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beating


@pytest.mark.asyncio
async def test_delete_node_and_changing_identity_are_audited(cp: ControlPlaneClient) -> None:
    await cp.beat("n1", region="us-east")
    await cp.beat("n1", region="us-east")
    await cp.beat("n1", region="us-east", model="other-model")  # a node may change its model
    assert (await cp.http.delete("/v1/nodes/n1", headers=cp.admin)).status_code == 204
    assert (await cp.http.get("/v1/nodes/n1", headers=cp.admin)).status_code == 404
    assert (await cp.http.delete("/v1/nodes/n1", headers=cp.admin)).status_code == 404
    entries = (await cp.http.get("/v1/audit", headers=cp.admin)).json()["entries"]
    assert [(e["action"], e["actor"]) for e in entries] == [
        ("node.credential", "admin"),
        ("node.register", "node"),
        ("node.update", "node"),
        ("node.delete", "admin"),
    ]
    assert entries[2]["detail"]["model"] == "other-model"


@pytest.mark.asyncio
async def test_known_nodes_take_the_fast_path_with_the_same_answers(
    cp: ControlPlaneClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    answered: list[bool] = []
    original = HeartbeatFastPath._answer

    async def spy(self: HeartbeatFastPath, scope: Any, body: bytes, send: Any) -> bool:
        answered.append(await original(self, scope, body, send))
        return answered[-1]

    monkeypatch.setattr(HeartbeatFastPath, "_answer", spy)
    await cp.add_region("us-east")
    first = await cp.beat("n1")  # registers: the FastAPI route
    again = await cp.beat("n1", kv_blocks_free=10, future_field=[1])
    assert answered == [False, True] and again == first
    assert cp.services.fleet.nodes["n1"].last_beat.kv_blocks_free == 10  # type: ignore[union-attr]

    # Anything unusual goes on to the route, body and all: the same errors as ever.
    body = heartbeat("n1")
    node = await cp.node_headers("n1")
    for headers, status in (
        ({}, 401),
        (cp.gateway, 403),
        (node | {"Content-Type": "text/plain"}, 422),  # as FastAPI answers it
    ):
        response = await cp.http.post(
            "/v1/nodes/heartbeat", content=json.dumps(body), headers=headers
        )
        assert response.status_code == status, response.text
    response = await cp.http.post(
        "/v1/nodes/heartbeat", json=body | {"kv_blocks_free": -1}, headers=await cp.node_headers()
    )
    assert response.status_code == 422 and "kv_blocks_free" in response.text
    # A beat from another URL is refused by the route (only an operator moves a node).
    response = await cp.http.post(
        "/v1/nodes/heartbeat",
        json=body | {"url": "http://127.0.0.1:9999"},
        headers=await cp.node_headers(),
    )
    assert response.status_code == 403 and answered[-1] is False
    assert cp.services.fleet.nodes["n1"].identity.url == body["url"]
    renamed = await cp.beat("n1", model="other-model")  # a new identity is a registration
    assert renamed["drain"] is False and answered[-1] is False
    assert cp.services.fleet.nodes["n1"].identity.model == "other-model"


@pytest.mark.asyncio
async def test_nodes_beating_while_a_registration_is_written_share_the_next_write(
    cp: ControlPlaneClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, registry = cp.services.store, cp.services.registry
    write, record = store.write, registry.record_heartbeat
    num_writes = num_beats = 0
    every_beat_in = asyncio.Event()
    for i in range(40):
        await cp.mint(f"n{i}")  # an operator's writes, one by one, before the nodes start

    async def counting(change: Any, changes: tuple[str, ...] = ()) -> Any:
        nonlocal num_writes
        if "nodes" in changes:  # not the health saves, which come on their own timer
            num_writes += 1
            if num_writes == 1:  # the first node's: held until every beat is in (a slow store)
                await asyncio.wait_for(every_beat_in.wait(), timeout=30.0)
        return await write(change, changes)

    async def arriving(actor: Any, beat: Heartbeat) -> Any:
        nonlocal num_beats
        num_beats += 1
        if num_beats == 40:
            every_beat_in.set()
        return await record(actor, beat)

    monkeypatch.setattr(store, "write", counting)
    monkeypatch.setattr(registry, "record_heartbeat", arriving)
    await cp.add_region("us-east")
    await asyncio.gather(*(cp.beat(f"n{i}") for i in range(40)))
    assert len(cp.services.fleet.nodes) == 40
    # The first node, then the 39 that came while it was written: one group commit.
    assert num_writes == 2
    entries = (await cp.http.get("/v1/audit", headers=cp.admin)).json()["entries"]
    assert sorted(e["target"] for e in entries if e["action"] == "node.register") == sorted(
        f"n{i}" for i in range(40)
    )
