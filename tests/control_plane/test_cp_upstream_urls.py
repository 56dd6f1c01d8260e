"""URLs that gateways and Envoy send requests (and the serving token) to: a region's ingress and a
node's address are `http(s)://HOST[:PORT]` only, never a link-local (metadata), unspecified,
multicast or reserved address, and inside the operator's `allowed_upstreams` when it is set."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from conftest import ControlPlaneClient, bearer, heartbeat, make_settings
from pydantic import ValidationError

from control_plane.app import create_app
from control_plane.settings import Settings
from control_plane.tokens import TokenSet

REFUSED = [
    "http://169.254.169.254",  # cloud metadata
    "http://[fe80::1]:80",
    "http://[::ffff:169.254.169.254]",
    "http://2852039166",  # 169.254.169.254 as a resolver reads it
    "http://0.0.0.0:8080",
    "http://224.0.0.1:80",
    "http://127.0.0.1:8080/internal/admin?steal=",
    "http://127.0.0.1:8080/v1",
    "http://127.0.0.1:8080?x=1",
    "http://127.0.0.1:8080#frag",
    "http://user:secret@127.0.0.1:8080",
    "ftp://127.0.0.1:21",
    "http://127.0.0.1:99999",
]
ACCEPTED = [
    "http://127.0.0.1:10000",
    "http://127.0.0.1:10000/",
    "http://[::1]:22",
    "http://10.0.0.1:6379",
    "https://us-east.ingress.example.com",
]


@pytest.mark.asyncio
@pytest.mark.parametrize("url", REFUSED)
async def test_bad_upstream_urls_are_refused_wherever_an_operator_gives_one(
    cp: ControlPlaneClient, url: str
) -> None:
    body = {"name": "us-east", "lat": 1.0, "lon": 2.0, "ingress_url": url}
    created = await cp.http.post("/v1/regions", json=body, headers=cp.admin)
    assert created.status_code == 422, created.text
    assert "ingress_url" in created.json()["error"]["message"]
    await cp.add_region("us-east")
    patched = await cp.http.patch(
        "/v1/regions/us-east", json={"ingress_url": url}, headers=cp.admin
    )
    assert patched.status_code == 422, patched.text
    minted = await cp.http.post(
        "/v1/nodes/n1/credential", json={"region": "us-east", "url": url}, headers=cp.admin
    )
    assert minted.status_code == 422, minted.text
    await cp.beat("n1")
    moved = await cp.http.patch("/v1/nodes/n1", json={"url": url}, headers=cp.admin)
    assert moved.status_code == 422, moved.text
    region = (await cp.http.get("/v1/regions/us-east", headers=cp.admin)).json()
    assert region["ingress_url"] is None


@pytest.mark.asyncio
@pytest.mark.parametrize("url", ACCEPTED)
async def test_scheme_host_and_port_are_accepted(cp: ControlPlaneClient, url: str) -> None:
    region = await cp.add_region("us-east", ingress_url=url)
    assert region["ingress_url"] == url


@pytest_asyncio.fixture
async def fenced(tmp_path: Path, tokens: TokenSet) -> AsyncIterator[ControlPlaneClient]:
    """A control plane whose operator allows loopback and names under ingress.example.com."""
    settings = make_settings(
        tmp_path / "cp.db", tokens, allowed_upstreams="127.0.0.0/8,ingress.example.com"
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://cp.test") as http:
            yield ControlPlaneClient(http=http, tokens=tokens, db_path=tmp_path, app=app)


@pytest.mark.asyncio
async def test_the_operators_allowlist_fences_every_url(fenced: ControlPlaneClient) -> None:
    cp = fenced
    for url in ("http://10.0.0.1:6379", "http://[::1]:22", "https://example.com"):
        body = {"name": "r1", "lat": 1.0, "lon": 2.0, "ingress_url": url}
        response = await cp.http.post("/v1/regions", json=body, headers=cp.admin)
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["code"] == "url_not_allowed" and "allowed_upstreams" in error["message"]
    for url in ("http://127.0.0.1:10000", "https://us-east.ingress.example.com"):
        await cp.add_region(f"r{len(url)}", ingress_url=url)
    minted = await cp.http.post(
        "/v1/nodes/n1/credential",
        json={"region": "us-east", "url": "http://10.0.0.5:9001"},
        headers=cp.admin,
    )
    assert minted.status_code == 422 and minted.json()["error"]["code"] == "url_not_allowed"

    # A credential minted without a URL lets the first beat bind one: only an allowed one.
    token = await cp.mint("n2", "us-east")
    outside = heartbeat("n2", url="http://10.0.0.5:9001")
    response = await cp.http.post("/v1/nodes/heartbeat", json=outside, headers=bearer(token))
    assert response.status_code == 403 and response.json()["error"]["code"] == "url_not_allowed"
    assert "n2" not in cp.services.fleet.nodes
    await cp.beat("n2", url="http://127.0.0.1:9002")
    assert cp.services.fleet.nodes["n2"].identity.url == "http://127.0.0.1:9002"


def test_a_bad_allowlist_entry_fails_at_start(tmp_path: Path, tokens: TokenSet) -> None:
    with pytest.raises(ValidationError, match="neither an IP network nor a DNS name"):
        make_settings(tmp_path / "cp.db", tokens, allowed_upstreams="10.0.0.0/33")
    settings = make_settings(tmp_path / "cp.db", tokens, allowed_upstreams=" fd00::/8 , a.b ")
    assert isinstance(settings, Settings) and settings.allowed_upstreams == ("fd00::/8", "a.b")
