"""API keys: the secret is shown once and stored only as a hash; revocation reaches the snapshot
that gateways watch."""

from __future__ import annotations

import asyncio
import hashlib
import time

import pytest
from conftest import ControlPlaneClient, settings_on_each_db

from control_plane.store.sqlite import SqliteStore
from wire.key_snapshot import KeySnapshot

settings = pytest.fixture(settings_on_each_db)  # every test on SQLite and PostgreSQL


async def create_key(cp: ControlPlaneClient, **fields: object) -> dict[str, object]:
    body = {"name": "team-a", "tenant": "acme", "rpm": 60, "tpm": 10_000} | fields
    response = await cp.http.post("/v1/keys", json=body, headers=cp.admin)
    assert response.status_code == 201, response.text
    created: dict[str, object] = response.json()
    return created


def db_bytes(cp: ControlPlaneClient) -> bytes:
    """The database and its WAL, as they are on disk."""
    paths = [cp.db_path, cp.db_path.with_name(cp.db_path.name + "-wal")]
    return b"".join(path.read_bytes() for path in paths if path.exists())


@pytest.mark.asyncio
async def test_secret_is_shown_once_and_stored_hashed(cp: ControlPlaneClient) -> None:
    created = await create_key(cp)
    secret = created["secret"]
    assert isinstance(secret, str) and secret.startswith("mer-") and len(secret) >= 40
    assert set(created) >= {"id", "secret", "name", "tenant", "rpm", "tpm", "created_at"}

    listed = (await cp.http.get("/v1/keys", headers=cp.admin)).json()["keys"]
    assert [key["id"] for key in listed] == [created["id"]]
    assert "secret" not in listed[0] and secret not in str(listed)
    assert listed[0]["revoked_at"] is None

    if isinstance(cp.services.store, SqliteStore):
        assert secret.encode() not in db_bytes(cp)
    digest = hashlib.sha256(secret.encode()).hexdigest()
    stored = cp.services.store.read_sync(
        lambda conn: [row["secret_sha256"] for row in conn.execute("SELECT * FROM api_keys")]
    )
    assert stored == [digest]
    audit = (await cp.http.get("/v1/audit", headers=cp.admin)).text
    assert secret not in audit


@pytest.mark.asyncio
async def test_snapshot_lists_hashes_and_limits_for_gateways(cp: ControlPlaneClient) -> None:
    created = await create_key(cp, rpm=5, tpm=500, tenant=None)
    response = await cp.http.get("/v1/keys/snapshot", headers=cp.gateway)
    assert response.status_code == 200
    snapshot = KeySnapshot.model_validate_json(response.content)
    assert int(response.headers["x-meridian-index"]) == snapshot.index
    (grant,) = snapshot.keys
    assert grant.id == created["id"] and (grant.rpm, grant.tpm, grant.tenant) == (5, 500, None)
    assert grant.secret_sha256 == hashlib.sha256(str(created["secret"]).encode()).hexdigest()


@pytest.mark.asyncio
async def test_revocation_wakes_a_waiting_gateway(cp: ControlPlaneClient) -> None:
    created = await create_key(cp)
    first = KeySnapshot.model_validate_json(
        (await cp.http.get("/v1/keys/snapshot", headers=cp.gateway)).content
    )
    assert len(first.keys) == 1

    async def watch() -> tuple[KeySnapshot, float]:
        started = time.monotonic()
        response = await cp.http.get(
            "/v1/keys/snapshot",
            params={"index": first.index, "wait": "10s"},
            headers=cp.gateway,
        )
        return KeySnapshot.model_validate_json(response.content), time.monotonic() - started

    watcher = asyncio.create_task(watch())
    await asyncio.sleep(0.2)
    assert not watcher.done()
    revoked = await cp.http.delete(f"/v1/keys/{created['id']}", headers=cp.admin)
    assert revoked.status_code == 204
    snapshot, waited_s = await asyncio.wait_for(watcher, timeout=5)
    assert snapshot.index > first.index and snapshot.keys == []
    assert waited_s < 5  # woken by the revocation, not its 10 s wait (how soon is no claim here)

    listed = (await cp.http.get("/v1/keys", headers=cp.admin)).json()["keys"]
    assert listed[0]["revoked_at"] is not None
    again = await cp.http.delete(f"/v1/keys/{created['id']}", headers=cp.admin)
    assert again.status_code == 409 and again.json()["error"]["code"] == "key_revoked"
    unknown = await cp.http.delete("/v1/keys/key_nope", headers=cp.admin)
    assert unknown.status_code == 404


@pytest.mark.asyncio
async def test_snapshot_wait_times_out_with_the_same_index(cp: ControlPlaneClient) -> None:
    index = int(
        (await cp.http.get("/v1/keys/snapshot", headers=cp.gateway)).headers["x-meridian-index"]
    )
    started = time.monotonic()
    response = await cp.http.get(
        "/v1/keys/snapshot", params={"index": index, "wait": "300ms"}, headers=cp.gateway
    )
    assert 0.25 <= time.monotonic() - started < 5  # its 300 ms wait; the bound: it did not hang
    assert int(response.headers["x-meridian-index"]) == index


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "body",
    [
        {"name": "x", "rpm": 0, "tpm": 1},
        {"name": "x", "rpm": 1, "tpm": -5},
        {"name": "", "rpm": 1, "tpm": 1},
        {"name": "x", "rpm": 1},
        {"name": "x", "rpm": 1, "tpm": 1, "secret": "chosen"},
    ],
)
async def test_bad_key_request_is_422(cp: ControlPlaneClient, body: dict[str, object]) -> None:
    response = await cp.http.post("/v1/keys", json=body, headers=cp.admin)
    assert response.status_code == 422, response.text
    assert (await cp.http.get("/v1/keys", headers=cp.admin)).json()["keys"] == []
