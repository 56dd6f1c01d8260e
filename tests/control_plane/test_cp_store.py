"""The SQLite store: WAL, migrations by user_version, and all-or-nothing changes."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from conftest import ControlPlaneClient

from control_plane import audit
from control_plane.audit import Actor
from control_plane.store import MIGRATIONS, Store, StoreError

ACTOR = Actor(kind="admin", client="test")


def test_new_store_is_wal_and_migrated(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "cp.db"))
    try:
        assert store.schema_version == len(MIGRATIONS)
        mode = store.read_sync(lambda conn: conn.execute("PRAGMA journal_mode").fetchone()[0])
        assert mode == "wal"
    finally:
        store.close()
    reopened = Store(str(tmp_path / "cp.db"))  # migrating again is a no-op
    assert reopened.schema_version == len(MIGRATIONS)
    reopened.close()


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "cp.db"
    with sqlite3.connect(path) as conn:
        conn.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
    with pytest.raises(StoreError, match="newer than this control plane"):
        Store(str(path))


def test_failed_change_writes_nothing(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "cp.db"))

    def change(conn: sqlite3.Connection) -> None:
        conn.execute(
            "INSERT INTO regions (name, lat, lon, ingress_url, weight, state, created_at, "
            "updated_at) VALUES ('r1', 0, 0, NULL, 1, 'active', 0, 0)",
        )
        audit.record(conn, ACTOR, "region.create", "r1", {})
        raise RuntimeError("crash after the audit row")

    with pytest.raises(RuntimeError):
        store.write_sync(change)
    counts = store.read_sync(
        lambda conn: (
            conn.execute("SELECT COUNT(*) FROM regions").fetchone()[0],
            conn.execute("SELECT COUNT(*) FROM audit_log").fetchone()[0],
        )
    )
    assert counts == (0, 0)
    # The connection is usable afterwards.
    store.write_sync(lambda conn: audit.record(conn, ACTOR, "x", "y", {}))
    assert (
        store.read_sync(lambda conn: conn.execute("SELECT COUNT(*) FROM audit_log").fetchone())[0]
        == 1
    )
    store.close()


@pytest.mark.asyncio
async def test_rejected_change_leaves_no_audit_entry(cp: ControlPlaneClient) -> None:
    await cp.add_region("us-east")
    duplicate = await cp.http.post(
        "/v1/regions", json={"name": "us-east", "lat": 0, "lon": 0}, headers=cp.admin
    )
    assert duplicate.status_code == 409
    entries = (await cp.http.get("/v1/audit", headers=cp.admin)).json()["entries"]
    assert [e["action"] for e in entries] == ["region.create"]
