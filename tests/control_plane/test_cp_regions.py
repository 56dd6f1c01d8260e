"""Region CRUD through the admin API: validation, conflicts, unknown names, persistence of edits."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from conftest import ControlPlaneClient, settings_on_each_db

from control_plane.drain.sequence import DrainSequence
from control_plane.model import Region
from control_plane.schemas import DrainView, RegionView, view_from

settings = pytest.fixture(settings_on_each_db)  # every test on SQLite and PostgreSQL


@pytest.mark.asyncio
async def test_region_lifecycle(cp: ControlPlaneClient) -> None:
    created = await cp.add_region(
        "eu-west", lat=53.3, lon=-6.3, ingress_url="http://127.0.0.1:10001", weight=2.0
    )
    assert created["state"] == "active" and created["weight"] == 2.0
    listed = (await cp.http.get("/v1/regions", headers=cp.admin)).json()["regions"]
    assert [r["name"] for r in listed] == ["eu-west"]
    one = (await cp.http.get("/v1/regions/eu-west", headers=cp.admin)).json()
    assert one == created

    patched = await cp.http.patch(
        "/v1/regions/eu-west", json={"state": "draining", "weight": 0.5}, headers=cp.admin
    )
    assert patched.status_code == 200, patched.text
    body = patched.json()
    assert (body["state"], body["weight"], body["lat"]) == ("draining", 0.5, 53.3)
    assert body["ingress_url"] == "http://127.0.0.1:10001"
    cleared = await cp.http.patch(
        "/v1/regions/eu-west", json={"ingress_url": None}, headers=cp.admin
    )
    assert cleared.json()["ingress_url"] is None

    deleted = await cp.http.delete("/v1/regions/eu-west", headers=cp.admin)
    assert deleted.status_code == 204 and deleted.content == b""
    gone = await cp.http.get("/v1/regions/eu-west", headers=cp.admin)
    assert gone.status_code == 404
    assert gone.json()["error"] == {
        "message": "region 'eu-west' not found",
        "type": "not_found_error",
        "param": None,
        "code": "region_not_found",
    }


@pytest.mark.asyncio
async def test_duplicate_region_is_409_and_leaves_the_first(cp: ControlPlaneClient) -> None:
    await cp.add_region("us-east", lat=40.0, lon=-74.0)
    again = await cp.http.post(
        "/v1/regions", json={"name": "us-east", "lat": 1.0, "lon": 2.0}, headers=cp.admin
    )
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "region_exists"
    one = (await cp.http.get("/v1/regions/us-east", headers=cp.admin)).json()
    assert (one["lat"], one["lon"]) == (40.0, -74.0)


@pytest.mark.asyncio
@pytest.mark.parametrize("method", ["GET", "PATCH", "DELETE"])
async def test_unknown_region_is_404(cp: ControlPlaneClient, method: str) -> None:
    body = {"weight": 1.0} if method == "PATCH" else None
    response = await cp.http.request(method, "/v1/regions/nowhere", json=body, headers=cp.admin)
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"name": "us-east", "lat": 91, "lon": 0}, "lat"),
        ({"name": "us-east", "lat": 0, "lon": -181}, "lon"),
        ({"name": "US East", "lat": 0, "lon": 0}, "name"),
        ({"name": "", "lat": 0, "lon": 0}, "name"),
        ({"name": "us-east", "lat": 0}, "lon"),
        ({"name": "us-east", "lat": 0, "lon": 0, "weight": -1}, "weight"),
        ({"name": "us-east", "lat": 0, "lon": 0, "state": "gone"}, "state"),
        ({"name": "us-east", "lat": 0, "lon": 0, "ingress_url": "ftp://x"}, "ingress_url"),
        ({"name": "us-east", "lat": 0, "lon": 0, "colour": "red"}, "colour"),
        ({"name": "us-east", "lat": "north", "lon": 0}, "lat"),
        ({"name": "us-east", "lat": 0, "lon": 0, "picker": "picker.local:9100"}, "picker"),
        ({"name": "us-east", "lat": 0, "lon": 0, "picker": "127.0.0.1"}, "picker"),
        ({"name": "us-east", "lat": 0, "lon": 0, "picker": "127.0.0.1:70000"}, "picker"),
    ],
)
async def test_bad_region_is_422_with_the_field_named(
    cp: ControlPlaneClient, body: dict[str, Any], fragment: str
) -> None:
    response = await cp.http.post("/v1/regions", json=body, headers=cp.admin)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "validation_error" and fragment in error["message"]
    listed = (await cp.http.get("/v1/regions", headers=cp.admin)).json()["regions"]
    assert listed == []


@pytest.mark.asyncio
async def test_bad_json_is_400(cp: ControlPlaneClient) -> None:
    response = await cp.http.post(
        "/v1/regions",
        content=b"{not json",
        headers=cp.admin | {"content-type": "application/json"},
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "patch",
    [{}, {"lat": None}, {"state": None}, {"lat": 100}, {"name": "other"}, {"picker": "x:1"}],
)
async def test_bad_patch_is_422_and_changes_nothing(
    cp: ControlPlaneClient, patch: dict[str, Any]
) -> None:
    before = await cp.add_region("us-east")
    response = await cp.http.patch("/v1/regions/us-east", json=patch, headers=cp.admin)
    assert response.status_code == 422, response.text
    after = (await cp.http.get("/v1/regions/us-east", headers=cp.admin)).json()
    assert after == before


@pytest.mark.asyncio
async def test_a_regions_picker_is_set_changed_and_cleared(cp: ControlPlaneClient) -> None:
    created = await cp.add_region("us-east", picker="127.0.0.1:9100")
    assert created["picker"] == "127.0.0.1:9100"
    moved = await cp.http.patch(
        "/v1/regions/us-east", json={"picker": "[::1]:9200"}, headers=cp.admin
    )
    assert moved.status_code == 200, moved.text
    assert (moved.json()["picker"], moved.json()["weight"]) == ("[::1]:9200", 1.0)
    cleared = await cp.http.patch("/v1/regions/us-east", json={"picker": None}, headers=cp.admin)
    assert cleared.json()["picker"] is None
    one = (await cp.http.get("/v1/regions/us-east", headers=cp.admin)).json()
    assert one["picker"] is None


@pytest.mark.asyncio
async def test_reserved_region_name_is_refused(cp: ControlPlaneClient) -> None:
    response = await cp.http.post(
        "/v1/regions", json={"name": "summary", "lat": 0, "lon": 0}, headers=cp.admin
    )
    assert response.status_code == 422
    assert "reserved" in response.json()["error"]["message"]


@pytest.mark.asyncio
async def test_unknown_route_and_method_are_json_errors(cp: ControlPlaneClient) -> None:
    missing = await cp.http.get("/v1/nothing", headers=cp.admin)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "route_not_found"
    wrong = await cp.http.put("/v1/regions", headers=cp.admin)
    assert wrong.status_code == 405
    assert wrong.json()["error"]["code"] == "method_not_allowed"


@pytest.mark.asyncio
async def test_deleting_a_region_with_nodes_drains_them_first(cp: ControlPlaneClient) -> None:
    await cp.add_region("eu-west", lat=53.3, lon=-6.3)
    await cp.beat("n1", region="eu-west")
    deleted = await cp.http.delete("/v1/regions/eu-west", headers=cp.admin)
    assert deleted.status_code == 202, deleted.text
    body = deleted.json()
    assert (body["state"], body["is_deleting"]) == ("draining", True)
    assert (await cp.http.delete("/v1/regions/eu-west", headers=cp.admin)).status_code == 202
    node = (await cp.http.get("/v1/nodes/n1", headers=cp.admin)).json()
    assert node["drain"]["reason"] == "region"
    assert (await cp.beat("n1", region="eu-west"))["drain"] is True
    # Setting it active again cancels the delete and the drain.
    patched = await cp.http.patch("/v1/regions/eu-west", json={"state": "active"}, headers=cp.admin)
    assert patched.json()["is_deleting"] is False
    assert (await cp.http.get("/v1/nodes/n1", headers=cp.admin)).json()["drain"] is None


def test_a_view_reads_its_fields_from_the_model_and_takes_the_computed_ones() -> None:
    region = Region("eu", 50.1, 8.7, None, 1.0, "active", created_at=1.0, updated_at=2.0)
    assert view_from(RegionView, region).model_dump() == dataclasses.asdict(region)
    sequence = DrainSequence("n1", "eu", "operator", started_at=3.0)
    view = view_from(DrainView, sequence, steps=[])
    assert (view.node_id, view.phase, view.may_exit, view.steps) == ("n1", "admissions", False, [])
