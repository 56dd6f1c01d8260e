"""Envoys' xDS credentials through the admin API: minted (the token shown once), listed without
tokens, replaced and deleted (the streams that hold them closed), each change audited."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from conftest import ControlPlaneClient
from test_xds_plan import INGRESS
from test_xds_server import FakeEnvoy

from control_plane.xds.resources import CLUSTER_TYPE


@pytest.mark.asyncio
async def test_credentials_are_minted_listed_and_deleted(cp: ControlPlaneClient) -> None:
    minted = await cp.http.post(
        "/v1/xds/credentials/ingress-us-east", json={"region": "us-east"}, headers=cp.admin
    )
    assert minted.status_code == 201, minted.text
    body = minted.json()
    assert (body["role"], body["region"]) == ("ingress", "us-east")
    assert body["token"].startswith("mxds-")
    edge = await cp.http.post("/v1/xds/credentials/edge", json={"role": "edge"}, headers=cp.admin)
    assert edge.status_code == 201
    listed = (await cp.http.get("/v1/xds/credentials", headers=cp.admin)).json()["credentials"]
    assert [(c["name"], c["role"], c["region"]) for c in listed] == [
        ("edge", "edge", None),
        ("ingress-us-east", "ingress", "us-east"),
    ]
    assert all("token" not in c for c in listed)
    gone = await cp.http.delete("/v1/xds/credentials/edge", headers=cp.admin)
    assert gone.status_code == 204
    again = await cp.http.delete("/v1/xds/credentials/edge", headers=cp.admin)
    assert again.status_code == 404
    entries = (await cp.http.get("/v1/audit", headers=cp.admin)).json()["entries"]
    assert [(e["action"], e["target"]) for e in entries] == [
        ("xds.credential", "ingress-us-east"),
        ("xds.credential", "edge"),
        ("xds.credential.delete", "edge"),
    ]
    assert body["token"] not in str(entries)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({}, 422),  # an ingress credential needs its region
        ({"role": "edge", "region": "us-east"}, 422),
        ({"role": "router", "region": "us-east"}, 422),
        ({"region": "US East"}, 422),
        ({"region": "us\u202eeast"}, 400),
    ],
)
async def test_bad_credential_requests_are_refused(
    cp: ControlPlaneClient, body: dict[str, str], status: int
) -> None:
    response = await cp.http.post("/v1/xds/credentials/x", json=body, headers=cp.admin)
    assert response.status_code == status, response.text
    refused = await cp.http.post("/v1/xds/credentials/x", json={"region": "r"}, headers=cp.gateway)
    assert refused.status_code == 403


@pytest.mark.asyncio
async def test_minting_again_closes_the_streams_of_the_old_token(cp: ControlPlaneClient) -> None:
    await cp.add_region("us-east")
    await cp.beat("n1")
    path = "/v1/xds/credentials/ingress-us-east"
    token = (await cp.http.post(path, json={"region": "us-east"}, headers=cp.admin)).json()["token"]
    xds = cp.services.xds
    assert xds is not None
    async with grpc.aio.insecure_channel(f"127.0.0.1:{xds.port}") as channel:
        envoy = FakeEnvoy(channel, token, group=INGRESS)
        envoy.open()
        await envoy.send(CLUSTER_TYPE)
        assert len((await envoy.receive()).resources) == 1
        replaced = await cp.http.post(path, json={"region": "us-east"}, headers=cp.admin)
        assert replaced.status_code == 201 and replaced.json()["token"] != token
        assert envoy.reader is not None
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await asyncio.wait_for(envoy.reader, 5.0)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
