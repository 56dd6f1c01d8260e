"""The routing policy and the status view."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import ControlPlaneClient

from wire.routing_policy import RoutingPolicy


@pytest.mark.asyncio
async def test_routing_policy_defaults_and_replace(cp: ControlPlaneClient) -> None:
    got = await cp.http.get("/v1/routing", headers=cp.admin)
    assert RoutingPolicy.model_validate(got.json()) == RoutingPolicy()
    put = await cp.http.put(
        "/v1/routing",
        json={"rtt_weight": 0.5, "p2c_tolerance": 0.3, "saturation_threshold": 0.8},
        headers=cp.admin,
    )
    assert put.status_code == 200
    again = RoutingPolicy.model_validate(
        (await cp.http.get("/v1/routing", headers=cp.admin)).json()
    )
    assert (again.rtt_weight, again.p2c_tolerance, again.saturation_threshold) == (0.5, 0.3, 0.8)
    assert again.queue_weight == 1.0 and again.affinity_enabled is True


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "body",
    [
        {"rtt_weight": 0, "queue_weight": 0},
        {"saturation_threshold": 0},
        {"saturation_threshold": 1.5},
        {"p2c_tolerance": -0.1},
        {"rtt_weight": -1},
        {"affinity": True},
    ],
)
async def test_bad_routing_policy_is_422(cp: ControlPlaneClient, body: dict[str, Any]) -> None:
    response = await cp.http.put("/v1/routing", json=body, headers=cp.admin)
    assert response.status_code == 422, response.text
    assert (
        await cp.http.get("/v1/routing", headers=cp.admin)
    ).json() == RoutingPolicy().model_dump()


@pytest.mark.asyncio
async def test_status_shows_the_whole_fleet(cp: ControlPlaneClient) -> None:
    await cp.add_region("us-east")
    await cp.add_region("eu-west", lat=53.3, lon=-6.3)
    await cp.beat("n1")
    await cp.beat("n2", region="eu-west")
    await cp.http.post("/v1/nodes/n2/drain", headers=cp.admin)
    await cp.beat("n2", region="eu-west", draining=True)
    await cp.services.drain_loop.step()
    status = (await cp.http.get("/v1/status", headers=cp.admin)).json()
    (drain,) = status["drains"]
    assert (drain["node_id"], drain["reason"], drain["phase"]) == ("n2", "operator", "dns")
    assert [step["name"] for step in drain["steps"] if step["completed_at"]] == [
        "admissions",
        "envoy",
        "summaries",
    ]
    assert status["nodes"][1]["drain"] == drain
    assert status["xds"]["num_envoys"] == 0
    assert (status["num_nodes"], status["num_healthy_nodes"], status["num_draining_nodes"]) == (
        2,
        2,
        1,
    )
    assert [r["name"] for r in status["regions"]] == ["eu-west", "us-east"]
    assert [r["healthy_nodes"] for r in status["regions"]] == [0, 1]
    assert [n["node_id"] for n in status["nodes"]] == ["n1", "n2"]
    assert status["heartbeat_interval_s"] == 0.2 and status["unhealthy_after_s"] == pytest.approx(
        0.6
    )
    assert status["summary_index"] == cp.services.summaries.current.index
