"""The store on both backends (SQLite, and a real PostgreSQL): migrations from the one list, a
newer schema refused, all-or-nothing changes; SQLite in WAL mode; an unreachable PostgreSQL URL
is one clear line and a non-zero exit."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO_ROOT, ControlPlaneClient, settings_on_each_db

from control_plane import audit
from control_plane.audit import Actor
from control_plane.store import open_store
from control_plane.store.base import Connection, Store, StoreError, of_row
from control_plane.store.migrations import MIGRATIONS
from control_plane.store.sqlite import SqliteStore

settings = pytest.fixture(settings_on_each_db)  # every test on SQLite and PostgreSQL

ACTOR = Actor(kind="admin", client="test")


def count(store_conn: Connection, table: str) -> int:
    return int(store_conn.execute(f"SELECT COUNT(*) AS n FROM {table}").fetchone()["n"])


def test_new_store_is_migrated_and_reopening_is_a_no_op(db: str) -> None:
    store = open_store(db)
    try:
        assert store.schema_version == len(MIGRATIONS)
        store.write_sync(lambda conn: audit.record(conn, ACTOR, "x", "y", {}))
    finally:
        store.close()
    reopened = open_store(db)
    try:
        assert reopened.schema_version == len(MIGRATIONS)
        assert reopened.read_sync(lambda conn: count(conn, "audit_log")) == 1
    finally:
        reopened.close()


def test_sqlite_store_is_wal(tmp_path: Path) -> None:
    store = SqliteStore(str(tmp_path / "cp.db"))
    try:
        mode = store.read_sync(lambda conn: conn.execute("PRAGMA journal_mode").fetchone()[0])
        assert mode == "wal"
    finally:
        store.close()


def test_newer_schema_is_refused(db: str) -> None:
    if db.startswith("postgresql://"):
        store = open_store(db)
        newer = len(MIGRATIONS) + 1
        store.write_sync(
            lambda conn: conn.execute("UPDATE meridian_schema SET version = ?", (newer,))
        )
        store.close()
    else:
        with sqlite3.connect(db) as conn:
            conn.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
    with pytest.raises(StoreError, match="newer than this control plane"):
        open_store(db)


def test_failed_change_writes_nothing(db: str) -> None:
    store = open_store(db)

    def change(conn: Connection) -> None:
        conn.execute(
            "INSERT INTO regions (name, lat, lon, ingress_url, weight, state, created_at, "
            "updated_at) VALUES ('r1', 0, 0, NULL, 1, 'active', 0, 0)",
        )
        audit.record(conn, ACTOR, "region.create", "r1", {})
        raise RuntimeError("crash after the audit row")

    try:
        with pytest.raises(RuntimeError):
            store.write_sync(change)
        counts = store.read_sync(lambda conn: (count(conn, "regions"), count(conn, "audit_log")))
        assert counts == (0, 0)
        # The connection is usable afterwards.
        store.write_sync(lambda conn: audit.record(conn, ACTOR, "x", "y", {}))
        assert store.read_sync(lambda conn: count(conn, "audit_log")) == 1
    finally:
        store.close()


@pytest.mark.slow
def test_unreachable_postgres_is_one_line_and_a_non_zero_exit(tmp_path: Path) -> None:
    pytest.importorskip("psycopg")
    url = "postgresql://meridian:hunter2@127.0.0.1:1/fleet"  # nothing listens on port 1
    result = subprocess.run(
        [sys.executable, "-m", "control_plane", "--db", url],
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("control_plane: cannot connect to PostgreSQL at ")
    assert "Connection refused" in lines[0] and "hunter2" not in lines[0]


@pytest.mark.asyncio
async def test_rejected_change_leaves_no_audit_entry(cp: ControlPlaneClient) -> None:
    await cp.add_region("us-east")
    duplicate = await cp.http.post(
        "/v1/regions", json={"name": "us-east", "lat": 0, "lon": 0}, headers=cp.admin
    )
    assert duplicate.status_code == 409
    entries = (await cp.http.get("/v1/audit", headers=cp.admin)).json()["entries"]
    assert [e["action"] for e in entries] == ["region.create"]


def test_replicas_opening_a_new_database_at_once_all_migrate_it(pg_url: str) -> None:
    """`meridian up` starts every replica at once on a fresh database: none may fail on the
    others' CREATE TABLE (CI saw "Key (typname, typnamespace)=(meridian_schema, ...) already
    exists" from a replica)."""
    num_replicas = 6
    ready = threading.Barrier(num_replicas)
    errors: list[BaseException] = []
    stores: list[Store] = []

    def open_one(replica: int) -> None:
        ready.wait()
        try:
            stores.append(open_store(pg_url, replica_id=f"r{replica}"))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=open_one, args=(i,)) for i in range(num_replicas)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert errors == []
        assert [store.schema_version for store in stores] == [len(MIGRATIONS)] * num_replicas
    finally:
        for store in stores:
            store.close()


@dataclass(frozen=True, slots=True)
class _Pair:
    name: str
    count: int
    is_on: bool = False


def test_of_row_reads_each_field_from_its_column_but_the_converted_ones() -> None:
    store = SqliteStore(":memory:")
    try:
        row, short = store.read_sync(
            lambda conn: (
                conn.execute("SELECT 'a' AS name, 3 AS count, 1 AS is_on").fetchone(),
                conn.execute("SELECT 'b' AS name, 4 AS count").fetchone(),
            )
        )
    finally:
        store.close()
    assert of_row(_Pair, row, is_on=bool(row["is_on"])) == _Pair("a", 3, True)
    assert of_row(_Pair, short, is_on=False) == _Pair("b", 4)
    with pytest.raises(IndexError):  # a field without its column is a mistake, not a default
        of_row(_Pair, short)
