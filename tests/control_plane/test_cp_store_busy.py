"""A database locked by another connection (a long transaction, a backup, a second process): a
write answers 503 with Retry-After once the busy timeout passes, and reads do not wait for it."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from conftest import ControlPlaneClient, make_settings

from control_plane.app import create_app
from control_plane.tokens import TokenSet

REGION = {"name": "us-east", "lat": 40.7, "lon": -74.0}
MAX_WAIT_S = 30.0


@contextlib.contextmanager
def locked(db_path: Path) -> Iterator[sqlite3.Connection]:
    """Another connection holding the database's write lock until the block ends."""
    conn = sqlite3.connect(db_path, isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    finally:
        conn.execute("ROLLBACK")
        conn.close()


@pytest_asyncio.fixture
async def slow_cp(tmp_path: Path, tokens: TokenSet) -> AsyncIterator[ControlPlaneClient]:
    """A control plane whose writes wait up to MAX_WAIT_S for a lock: long enough that a read
    answered while a write waits proves the read did not queue behind it."""
    settings = make_settings(tmp_path / "cp.db", tokens, db_busy_timeout_s=MAX_WAIT_S)
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://cp.test") as http:
            yield ControlPlaneClient(http=http, tokens=tokens, db_path=tmp_path / "cp.db", app=app)


@pytest.mark.asyncio
async def test_a_write_to_a_locked_database_is_503_with_retry_after(
    tmp_path: Path, tokens: TokenSet
) -> None:
    settings = make_settings(tmp_path / "cp.db", tokens, db_busy_timeout_s=0.2)
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://cp.test") as http:
            cp = ControlPlaneClient(http=http, tokens=tokens, db_path=tmp_path / "cp.db", app=app)
            with locked(cp.db_path):
                response = await http.post("/v1/regions", json=REGION, headers=cp.admin)
            assert response.status_code == 503, response.text
            assert response.headers["retry-after"] == "1"
            error = response.json()["error"]
            assert error["code"] == "store_busy" and error["type"] == "service_unavailable"
            # Nothing was half-done, and the same call succeeds once the lock is gone.
            assert cp.services.fleet.regions == {}
            retried = await http.post("/v1/regions", json=REGION, headers=cp.admin)
            assert retried.status_code == 201, retried.text


@pytest.mark.asyncio
async def test_reads_do_not_wait_behind_a_blocked_write(slow_cp: ControlPlaneClient) -> None:
    cp = slow_cp
    store = cp.services.store
    with locked(cp.db_path):
        write = asyncio.create_task(cp.http.post("/v1/regions", json=REGION, headers=cp.admin))
        deadline = time.monotonic() + MAX_WAIT_S
        while not store.is_writing:  # the write has its connection and waits for the lock
            assert time.monotonic() < deadline and not write.done()
            await asyncio.sleep(0.01)
        read = asyncio.create_task(cp.http.get("/v1/keys", headers=cp.admin))
        audit = asyncio.create_task(cp.http.get("/v1/audit", headers=cp.admin))
        done, _ = await asyncio.wait({read, audit}, timeout=MAX_WAIT_S / 2)
        assert done == {read, audit} and not write.done()
        assert read.result().status_code == 200 and audit.result().status_code == 200
    assert (await write).status_code == 201  # and it goes through once the lock is released
