"""The audit log: every change, who made it (token kind and client), when, and what it replaced;
refused calls, at a bounded rate; paged reads."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
from conftest import ControlPlaneClient, bearer, heartbeat, settings_on_each_db

from control_plane.audit import Actor
from control_plane.refusals import Refusal, RefusalAudit, RefusalCounter, RefusalLimits

settings = pytest.fixture(settings_on_each_db)  # every test on SQLite and PostgreSQL


@pytest.mark.asyncio
async def test_every_change_is_audited(cp: ControlPlaneClient) -> None:
    started = time.time()
    await cp.add_region("us-east")
    await cp.http.patch("/v1/regions/us-east", json={"weight": 3}, headers=cp.admin)
    await cp.beat("n1")
    await cp.http.post("/v1/nodes/n1/drain", headers=cp.admin)
    await cp.http.post("/v1/nodes/n1/undrain", headers=cp.admin)
    moved = {"url": "http://127.0.0.1:9999"}
    assert (await cp.http.patch("/v1/nodes/n1", json=moved, headers=cp.admin)).is_success
    key = (
        await cp.http.post("/v1/keys", json={"name": "k", "rpm": 1, "tpm": 2}, headers=cp.admin)
    ).json()
    await cp.http.delete(f"/v1/keys/{key['id']}", headers=cp.admin)
    await cp.http.put("/v1/routing", json={"queue_weight": 2}, headers=cp.admin)
    await cp.http.delete("/v1/nodes/n1", headers=cp.admin)
    await cp.http.delete("/v1/regions/us-east", headers=cp.admin)
    # Reads and plain heartbeats are not changes.
    await cp.mint("n2")
    await cp.beat("n2")
    await cp.beat("n2")
    await cp.http.get("/v1/status", headers=cp.admin)
    await cp.services.drain_loop.step()  # the drain sequence writes its own entries as it moves

    response = await cp.http.get("/v1/audit", headers=cp.admin)
    everything = response.json()["entries"]
    drains = [(e["action"], e["target"], e["actor"]) for e in everything if "drain." in e["action"]]
    assert drains == [
        ("drain.start", "n1", "control_plane"),
        ("drain.cancel", "n1", "control_plane"),
    ]
    entries = [e for e in everything if not e["action"].startswith("drain.")]
    assert [(e["action"], e["target"], e["actor"]) for e in entries] == [
        ("region.create", "us-east", "admin"),
        ("region.update", "us-east", "admin"),
        ("node.credential", "n1", "admin"),
        ("node.register", "n1", "node"),
        ("node.drain", "n1", "admin"),
        ("node.undrain", "n1", "admin"),
        ("node.move", "n1", "admin"),
        ("key.create", key["id"], "admin"),
        ("key.revoke", key["id"], "admin"),
        ("routing.replace", "routing", "admin"),
        ("node.delete", "n1", "admin"),
        ("region.delete", "us-east", "admin"),
        ("node.credential", "n2", "admin"),
        ("node.register", "n2", "node"),
    ]
    assert entries[1]["detail"] == {"weight": 3.0, "old": {"weight": 1.0}}
    assert all(started <= e["at"] <= time.time() for e in entries)
    assert all(e["client"].startswith("127.0.0.1:") for e in entries)
    assert "python-httpx" in entries[0]["client"]

    page = await cp.http.get(
        "/v1/audit", params={"after_id": everything[2]["id"], "limit": 2}, headers=cp.admin
    )
    assert [e["id"] for e in page.json()["entries"]] == [everything[3]["id"], everything[4]["id"]]
    bad = await cp.http.get("/v1/audit", params={"limit": 0}, headers=cp.admin)
    assert bad.status_code == 422


async def audit_entries(cp: ControlPlaneClient, action: str | None = None) -> list[dict[str, Any]]:
    response = await cp.http.get("/v1/audit", params={"limit": 1000}, headers=cp.admin)
    assert response.status_code == 200, response.text
    entries: list[dict[str, Any]] = response.json()["entries"]
    return [e for e in entries if action is None or e["action"] == action]


@pytest.mark.asyncio
async def test_every_change_records_what_it_replaced(cp: ControlPlaneClient) -> None:
    await cp.add_region("us-east", weight=1.0)
    patch = {"weight": 2.0, "ingress_url": "http://127.0.0.1:10000", "lat": 40.7}
    assert (await cp.http.patch("/v1/regions/us-east", json=patch, headers=cp.admin)).is_success
    first_url = heartbeat("n1")["url"]
    await cp.beat("n1")
    await cp.http.post("/v1/nodes/n1/drain", headers=cp.admin)
    moved = {"url": "http://127.0.0.1:9999"}
    assert (await cp.http.patch("/v1/nodes/n1", json=moved, headers=cp.admin)).is_success
    await cp.mint("n1", url="http://127.0.0.1:9999")  # a new token replaces the first
    await cp.http.put("/v1/routing", json={"queue_weight": 2}, headers=cp.admin)
    await cp.http.put("/v1/routing", json={"queue_weight": 3}, headers=cp.admin)
    await cp.http.delete("/v1/nodes/n1", headers=cp.admin)
    await cp.http.delete("/v1/regions/us-east", headers=cp.admin)

    by_action = {(e["action"], e["target"]): e["detail"] for e in await audit_entries(cp)}
    update = by_action["region.update", "us-east"]
    assert update["old"] == {"weight": 1.0, "ingress_url": None}  # lat did not change
    assert update["weight"] == 2.0 and update["ingress_url"] == "http://127.0.0.1:10000"
    assert by_action["node.drain", "n1"]["old"] == {"drain_requested": False}
    assert by_action["node.move", "n1"]["old"] == {"url": first_url}
    minted = [e for e in await audit_entries(cp, "node.credential") if e["target"] == "n1"]
    assert "old" not in minted[0]["detail"]
    assert minted[1]["detail"]["old"]["url"] == "http://127.0.0.1:9999"  # rebound by the move
    routing = await audit_entries(cp, "routing.replace")
    assert routing[0]["detail"]["old"]["queue_weight"] == 1.0
    assert routing[1]["detail"]["old"]["queue_weight"] == 2.0
    assert routing[1]["detail"]["queue_weight"] == 3.0
    deleted = by_action["node.delete", "n1"]["old"]
    assert deleted["url"] == "http://127.0.0.1:9999" and deleted["drain_requested"] is True
    region = by_action["region.delete", "us-east"]["old"]
    assert region["weight"] == 2.0 and region["state"] == "active"


@pytest.mark.asyncio
async def test_refused_calls_are_in_the_audit_log_and_the_log(
    cp: ControlPlaneClient, caplog: pytest.LogCaptureFixture
) -> None:
    await cp.add_region("us-east")
    await cp.mint("n1", "us-east")
    caplog.set_level(logging.WARNING, logger="control_plane.refusals")
    assert (await cp.http.get("/v1/regions")).status_code == 401
    wrong = bearer("not-a-token-" + "x" * 20) | {"user-agent": "probe\x1b[31m/1"}
    assert (await cp.http.delete("/v1/regions/us-east", headers=wrong)).status_code == 401
    assert (await cp.http.get("/v1/nodes", headers=cp.gateway)).status_code == 403
    elsewhere = heartbeat("n1", "eu-west")  # its credential binds it to us-east
    response = await cp.http.post(
        "/v1/nodes/heartbeat", json=elsewhere, headers=bearer(cp.node_tokens["n1"])
    )
    assert response.status_code == 403

    refused = await audit_entries(cp, "auth.refused")
    assert [
        (e["actor"], e["target"], e["detail"]["status"], e["detail"]["code"]) for e in refused
    ] == [
        ("anonymous", "GET /v1/regions", 401, "missing_api_key"),
        ("anonymous", "DELETE /v1/regions/us-east", 401, "invalid_api_key"),
        ("gateway", "GET /v1/nodes", 403, "wrong_token_kind"),
        ("node", "POST /v1/nodes/heartbeat", 403, "region_mismatch"),
    ]
    assert all(e["client"].startswith("127.0.0.1:") for e in refused)
    assert "probe\\x1b[31m/1" in refused[1]["client"]  # escaped, never as sent
    assert "'us-east', not 'eu-west'" in refused[3]["detail"]["message"]
    assert "us-east" in [e["target"] for e in await audit_entries(cp, "region.create")]
    logged = [r.getMessage() for r in caplog.records if r.name == "control_plane.refusals"]
    assert len(logged) == 4 and "region_mismatch" in logged[3]
    assert all(cp.tokens.admin not in line and "not-a-token" not in line for line in logged)


@pytest.mark.asyncio
async def test_a_flood_of_refusals_writes_a_bounded_number_of_entries(
    cp: ControlPlaneClient,
) -> None:
    limits = RefusalLimits(max_per_address=3, max_total=5, window_s=60.0)
    now = [1000.0]
    audit = RefusalAudit(cp.services.store, limits, clock=lambda: now[0])
    object.__setattr__(cp.services, "refusals", audit)
    for _ in range(40):
        assert (await cp.http.get("/v1/status")).status_code == 401
    assert len(await audit_entries(cp, "auth.refused")) == 3  # one address: its 3
    for address in ("10.0.0.1", "10.0.0.2", "10.0.0.3"):
        actor = Actor("anonymous", address + ":1")
        await audit.record(Refusal(address, actor, 401, "invalid_api_key", "xds", "no token"))
    assert len(await audit_entries(cp, "auth.refused")) == 5  # and 5 in all
    assert await audit_entries(cp, "auth.suppressed") == []

    now[0] += 61.0  # the next window: the next refusal first sums up the last one
    actor = Actor("anonymous", "10.0.0.9:1")
    await audit.record(Refusal("10.0.0.9", actor, 401, "invalid_api_key", "xds", "no token"))
    (summary,) = await audit_entries(cp, "auth.suppressed")
    assert summary["detail"]["num_suppressed"] == 37 + 1
    assert summary["detail"]["num_addresses"] == 2
    assert summary["detail"]["top_addresses"] == "127.0.0.1 (37), 10.0.0.3 (1)"
    assert len(await audit_entries(cp, "auth.refused")) == 6


def test_refusal_counter_bounds_addresses_and_windows() -> None:
    counter = RefusalCounter(RefusalLimits(max_per_address=2, max_total=1000, window_s=10.0))
    assert [counter.note("a", 0.0)[0] for _ in range(4)] == [True, True, False, False]
    assert counter.note("b", 1.0) == (True, None)
    assert counter.tick(9.9) is None  # the window is not over
    ended = counter.tick(10.0)
    assert ended is not None and ended.num_suppressed == 2 and ended.top == (("a", 2),)
    assert counter.tick(30.0) is None  # a window with nothing left out sums up to nothing
    assert counter.note("a", 31.0) == (True, None)  # a new window, a new allowance
