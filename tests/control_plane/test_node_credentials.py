"""Per-node credentials: a node's token speaks only for its own node id, region and URL; moving a
node is an operator's act."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from conftest import ControlPlaneClient, bearer, heartbeat

from control_plane.audit import Actor
from control_plane.fleet.credentials import CredentialRegistry
from control_plane.store import open_store
from control_plane.store.base import Connection

NEW_URL = "http://127.0.0.1:9555"


async def post_beat(cp: ControlPlaneClient, token: str, **fields: Any) -> Any:
    body = heartbeat(**fields)
    return await cp.http.post("/v1/nodes/heartbeat", json=body, headers=bearer(token))


async def known_nodes(cp: ControlPlaneClient) -> dict[str, Any]:
    nodes = (await cp.http.get("/v1/nodes", headers=cp.admin)).json()["nodes"]
    return {node["node_id"]: node for node in nodes}


@pytest.mark.asyncio
async def test_a_node_token_cannot_register_another_node(cp: ControlPlaneClient) -> None:
    await cp.add_region("us-east")
    token = await cp.mint("n1", "us-east")
    response = await post_beat(cp, token, node_id="n2")
    assert response.status_code == 403
    error = response.json()["error"]
    assert error["code"] == "node_id_mismatch" and "'n1'" in error["message"]
    assert await known_nodes(cp) == {}


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("change", "code"),
    [({"region": "eu-west"}, "region_mismatch"), ({"url": NEW_URL}, "url_mismatch")],
)
async def test_a_heartbeat_cannot_move_its_node(
    cp: ControlPlaneClient, change: dict[str, str], code: str
) -> None:
    await cp.add_region("us-east")
    await cp.add_region("eu-west", lat=53.3, lon=-6.3)
    await cp.beat("n1")  # registers n1 in us-east, and binds its URL
    registered = (await known_nodes(cp))["n1"]
    for _ in range(2):  # the first refusal, and a known node's (fast path) one alike
        response = await post_beat(cp, cp.node_tokens["n1"], **change)
        assert response.status_code == 403, response.text
        error = response.json()["error"]
        assert error["code"] == code and "PATCH /v1/nodes/n1" in error["message"]
    now = (await known_nodes(cp))["n1"]
    assert (now["region"], now["url"]) == (registered["region"], registered["url"])


@pytest.mark.asyncio
async def test_a_url_given_at_minting_binds_the_first_beat(cp: ControlPlaneClient) -> None:
    token = await cp.mint("n1", "us-east", url=NEW_URL)
    assert (await post_beat(cp, token)).status_code == 403  # heartbeat() picks another URL
    assert (await post_beat(cp, token, url=NEW_URL)).status_code == 200


@pytest.mark.asyncio
async def test_an_operator_moves_a_node_and_old_beats_are_refused(cp: ControlPlaneClient) -> None:
    await cp.add_region("us-east")
    await cp.add_region("eu-west", lat=53.3, lon=-6.3)
    await cp.beat("n1")
    patch = {"region": "eu-west", "url": NEW_URL}
    response = await cp.http.patch("/v1/nodes/n1", json=patch, headers=cp.admin)
    assert response.status_code == 200, response.text
    assert (response.json()["region"], response.json()["url"]) == ("eu-west", NEW_URL)
    summary = {r.name: r.healthy_nodes for r in cp.services.summaries.current.regions}
    assert summary == {"eu-west": 1, "us-east": 0}  # routing follows at once
    token = cp.node_tokens["n1"]
    assert (await post_beat(cp, token)).status_code == 403  # from where it used to be
    assert (await post_beat(cp, token, region="eu-west", url=NEW_URL)).status_code == 200
    entries = (await cp.http.get("/v1/audit", headers=cp.admin)).json()["entries"]
    (move,) = [e for e in entries if e["action"] == "node.move"]
    assert move["actor"] == "admin" and move["detail"]["old"]["region"] == "us-east"
    assert entries[-1]["action"] == "auth.refused"  # the beat from where it used to be
    # A node token cannot move a node itself; bad or empty patches are refused.
    node_token = await cp.node_headers("n1")
    assert (await cp.http.patch("/v1/nodes/n1", json=patch, headers=node_token)).status_code == 403
    for bad in ({}, {"region": None}, {"url": "ftp://x"}):
        response = await cp.http.patch("/v1/nodes/n1", json=bad, headers=cp.admin)
        assert response.status_code == 422, bad
    response = await cp.http.patch("/v1/nodes/n9", json=patch, headers=cp.admin)
    assert response.status_code == 404


@pytest.mark.asyncio
async def test_minting_again_replaces_the_token_which_is_stored_hashed(
    cp: ControlPlaneClient,
) -> None:
    first = await cp.mint("n1")
    assert (await post_beat(cp, first)).status_code == 200
    second = await cp.mint("n1")
    response = await post_beat(cp, first)
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert (await post_beat(cp, second)).status_code == 200
    with sqlite3.connect(cp.db_path) as conn:
        dump = "\n".join(conn.iterdump())
    assert first not in dump and second not in dump
    response = await cp.http.post(
        "/v1/nodes/n1/credential", json={"region": "Not A Name"}, headers=cp.admin
    )
    assert response.status_code == 422


@pytest.mark.asyncio
async def test_following_another_replica_never_undoes_a_credential_minted_here(
    tmp_path: Path,
) -> None:
    """A follow's read taken before a local mint committed, and back after the mint was put in
    memory, must not wipe the new credential (its node would get 401 until the next change)."""
    store = open_store(str(tmp_path / "cp.db"))
    credentials = CredentialRegistry(store, [])
    snapshot_taken, mint_done = asyncio.Event(), asyncio.Event()
    read = store.read

    async def slow_first_read(query: Callable[[Connection], Any]) -> Any:
        result = await read(query)
        if not snapshot_taken.is_set():
            snapshot_taken.set()
            await mint_done.wait()
        return result

    with mock.patch.object(store, "read", slow_first_read):
        following = asyncio.create_task(credentials.follow())
        await snapshot_taken.wait()  # the store had no credential when it was read
        _, token = await credentials.mint(Actor("admin", "test"), "n1", "us-east", None)
        mint_done.set()
        await following
    found = credentials.find(token)
    assert found is not None and found.node_id == "n1"
    store.close()


@pytest.mark.asyncio
async def test_following_named_credentials_reads_only_those(tmp_path: Path) -> None:
    """A mint elsewhere names its node (`credentials=<id>`): the follower reads that row alone,
    and a follow that names none reads every row."""
    store = open_store(str(tmp_path / "cp.db"))
    here, elsewhere = CredentialRegistry(store, []), CredentialRegistry(store, [])
    admin = Actor("admin", "test")
    _, first = await elsewhere.mint(admin, "n1", "us-east", None)
    _, second = await elsewhere.mint(admin, "n2", "us-east", None)
    await here.follow({"n1", "n9"})  # n9 has no credential: nothing to read for it
    assert here.find(first) is not None and here.find(second) is None
    _, replaced = await elsewhere.mint(admin, "n1", "us-east", None)
    await here.follow({"n1"})
    assert here.find(first) is None and here.find(replaced) is not None
    await here.follow(None)
    assert here.find(second) is not None
    store.close()
