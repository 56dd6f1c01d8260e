"""Names and labels an operator gives (in bodies and paths) refuse control, format (bidi) and
separator characters with a 400 in the error shape; other non-ASCII text is kept as given."""

from __future__ import annotations

from urllib.parse import quote

import pytest
from conftest import ControlPlaneClient

UNSAFE = ["\n", "\u2028", "\u2029", "\u202e", "\u200b", "\x07", "\x85", "\ufeff"]


def assert_refused(response: object, fragment: str) -> None:
    status = getattr(response, "status_code", None)
    body = response.json()  # type: ignore[attr-defined]
    assert status == 400, body
    error = body["error"]
    assert error["code"] == "invalid_characters" and error["type"] == "invalid_request_error"
    assert fragment in error["message"], error


@pytest.mark.asyncio
@pytest.mark.parametrize("char", UNSAFE)
async def test_key_names_and_tenants_refuse_unsafe_characters(
    cp: ControlPlaneClient, char: str
) -> None:
    for field in ("name", "tenant"):
        body = {"name": "team", "tenant": "acme", "rpm": 1, "tpm": 1} | {field: f"a{char}b"}
        response = await cp.http.post("/v1/keys", json=body, headers=cp.admin)
        assert_refused(response, f"U+{ord(char):04X}")
    keys = await cp.http.get("/v1/keys", headers=cp.admin)
    assert keys.json()["keys"] == []


@pytest.mark.asyncio
async def test_region_and_node_names_refuse_them_in_bodies_and_paths(
    cp: ControlPlaneClient,
) -> None:
    body = {"name": "us\u202eeast", "lat": 1.0, "lon": 2.0}
    response = await cp.http.post("/v1/regions", json=body, headers=cp.admin)
    assert_refused(response, "RIGHT-TO-LEFT OVERRIDE")
    await cp.add_region("us-east")
    for method, path in (
        ("GET", "/v1/regions/{}"),
        ("PATCH", "/v1/regions/{}"),
        ("DELETE", "/v1/regions/{}"),
        ("GET", "/v1/nodes/{}"),
        ("POST", "/v1/nodes/{}/drain"),
        ("POST", "/v1/nodes/{}/credential"),
        ("DELETE", "/v1/keys/{}"),
    ):
        url = path.format(quote("us\u2028east"))
        json = {"weight": 2.0} if method == "PATCH" else {"region": "us-east"}
        response = await cp.http.request(method, url, json=json, headers=cp.admin)
        assert_refused(response, "LINE SEPARATOR")
    moved = await cp.http.post(
        "/v1/nodes/n1/credential", json={"region": "us\u2029east"}, headers=cp.admin
    )
    assert_refused(moved, "PARAGRAPH SEPARATOR")


@pytest.mark.asyncio
async def test_authentication_comes_before_the_name_check(cp: ControlPlaneClient) -> None:
    response = await cp.http.get("/v1/regions/" + quote("a\u202eb"))
    assert response.status_code == 401


@pytest.mark.asyncio
async def test_other_non_ascii_labels_are_kept(cp: ControlPlaneClient) -> None:
    body = {"name": "Zürich — équipe 東京", "tenant": "Ωmega", "rpm": 1, "tpm": 1}
    response = await cp.http.post("/v1/keys", json=body, headers=cp.admin)
    assert response.status_code == 201, response.text
    assert response.json()["name"] == body["name"] and response.json()["tenant"] == "Ωmega"
