"""The audit log: every change, who made it (token kind and client), when; paged reads."""

from __future__ import annotations

import time

import pytest
from conftest import ControlPlaneClient, settings_on_each_db

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
    await (
        cp.services.registry.step_drains()
    )  # the drain sequence writes its own entries as it moves

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
    assert entries[1]["detail"] == {"weight": 3.0}
    assert all(started <= e["at"] <= time.time() for e in entries)
    assert all(e["client"].startswith("127.0.0.1:") for e in entries)
    assert "python-httpx" in entries[0]["client"]

    page = await cp.http.get(
        "/v1/audit", params={"after_id": everything[2]["id"], "limit": 2}, headers=cp.admin
    )
    assert [e["id"] for e in page.json()["entries"]] == [everything[3]["id"], everything[4]["id"]]
    bad = await cp.http.get("/v1/audit", params={"limit": 0}, headers=cp.admin)
    assert bad.status_code == 422
