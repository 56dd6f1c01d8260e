"""The SQLite store: WAL mode, schema migrations, one transaction per change.

Every change runs as one function inside `BEGIN IMMEDIATE ... COMMIT` (its audit-log row
included), so a failure anywhere rolls the whole change back: nothing is half-written. Calls run
in a worker thread (`await store.write(fn)`), so the event loop never blocks on disk. Writes share
one connection (serialized by a lock); reads have their own, so that with WAL they see the last
commit and proceed while a writer holds the database lock (another process's included). A write
that cannot get the lock within `busy_timeout_s` raises `StoreBusyError` (answered 503 with
Retry-After): the database is busy, not broken.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import anyio.to_thread

logger = logging.getLogger(__name__)

T = TypeVar("T")
MEMORY_PATH = ":memory:"

# Append only: migration N (1-based) moves a database from user_version N-1 to N.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """CREATE TABLE regions (
            name TEXT PRIMARY KEY,
            lat REAL NOT NULL,
            lon REAL NOT NULL,
            ingress_url TEXT,
            weight REAL NOT NULL,
            state TEXT NOT NULL CHECK (state IN ('active', 'draining', 'disabled')),
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL
        )""",
        """CREATE TABLE nodes (
            node_id TEXT PRIMARY KEY,
            region TEXT NOT NULL,
            url TEXT NOT NULL,
            model TEXT NOT NULL,
            tp_size INTEGER NOT NULL,
            drain_requested INTEGER NOT NULL DEFAULT 0,
            registered_at REAL NOT NULL,
            updated_at REAL NOT NULL
        )""",
        """CREATE TABLE api_keys (
            id TEXT PRIMARY KEY,
            name TEXT NOT NULL,
            tenant TEXT,
            secret_sha256 TEXT NOT NULL UNIQUE,
            rpm INTEGER NOT NULL,
            tpm INTEGER NOT NULL,
            created_at REAL NOT NULL,
            revoked_at REAL
        )""",
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
        """CREATE TABLE audit_log (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            at REAL NOT NULL,
            actor TEXT NOT NULL,
            client TEXT NOT NULL,
            action TEXT NOT NULL,
            target TEXT NOT NULL,
            detail TEXT NOT NULL
        )""",
    ),
    (
        # The drain sequence of each draining node (control_plane/drain.py): survives restarts.
        """CREATE TABLE drains (
            node_id TEXT PRIMARY KEY,
            region TEXT NOT NULL,
            reason TEXT NOT NULL,
            phase TEXT NOT NULL,
            started_at REAL NOT NULL,
            steps TEXT NOT NULL,
            updated_at REAL NOT NULL
        )""",
        # DELETE /v1/regions/{name} drains the region's nodes first.
        "ALTER TABLE regions ADD COLUMN is_deleting INTEGER NOT NULL DEFAULT 0",
    ),
    (
        # Each node's own heartbeat credential (control_plane/node_credentials.py): the node id,
        # region and URL its beats may carry. `url` is NULL until the first beat binds it.
        """CREATE TABLE node_credentials (
            node_id TEXT PRIMARY KEY,
            region TEXT NOT NULL,
            url TEXT,
            secret_sha256 TEXT NOT NULL UNIQUE,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL
        )""",
    ),
    (
        # The nodes that were beating, with their latest beat (control_plane/health_snapshot.py):
        # a restarted control plane keeps them healthy for a grace period.
        """CREATE TABLE node_health (
            node_id TEXT PRIMARY KEY,
            beat TEXT NOT NULL,
            seen_at REAL NOT NULL
        )""",
    ),
)


class StoreError(Exception):
    """The database cannot be used (e.g. written by a newer control plane)."""


class StoreBusyError(Exception):
    """Another connection held the database lock for longer than the busy timeout."""


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    return exc.sqlite_errorcode in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


def _connect(path: str, busy_timeout_s: float) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.row_factory = sqlite3.Row
    conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000):d}")
    return conn


class Store:
    def __init__(self, path: str, busy_timeout_s: float = 5.0) -> None:
        self.busy_timeout_s = busy_timeout_s
        self._lock = threading.Lock()
        self._conn = _connect(path, busy_timeout_s)
        try:
            mode = self._conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            # With WAL, NORMAL keeps every commit atomic and consistent; a power cut may lose the
            # last few commits but never corrupts the file.
            self._conn.execute("PRAGMA synchronous = NORMAL")
            self._migrate()
            # An in-memory database exists only on its one connection: reads must share it.
            self._read_conn = self._conn if path == MEMORY_PATH else _connect(path, busy_timeout_s)
        except BaseException:
            self._conn.close()
            raise
        self._read_lock = self._lock if self._read_conn is self._conn else threading.Lock()
        logger.info("store %s open (journal_mode=%s, schema v%d)", path, mode, self.schema_version)

    @property
    def is_writing(self) -> bool:
        """A change holds the write connection (running, or waiting for the database lock)."""
        return self._lock.locked()

    @property
    def schema_version(self) -> int:
        with self._read_lock:
            return int(self._read_conn.execute("PRAGMA user_version").fetchone()[0])

    def _migrate(self) -> None:
        version = int(self._conn.execute("PRAGMA user_version").fetchone()[0])
        if version > len(MIGRATIONS):
            raise StoreError(
                f"database schema v{version} is newer than this control plane "
                f"(knows up to v{len(MIGRATIONS)})"
            )
        for target, statements in enumerate(MIGRATIONS[version:], start=version + 1):
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                for statement in statements:
                    self._conn.execute(statement)
                self._conn.execute(f"PRAGMA user_version = {target:d}")
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            logger.info("migrated store to schema v%d", target)

    def write_sync(self, change: Callable[[sqlite3.Connection], T]) -> T:
        """Run `change` in one transaction: all of it is committed, or none of it."""
        with self._lock:
            try:
                self._conn.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as exc:
                if _is_busy(exc):
                    raise StoreBusyError(str(exc)) from exc
                raise
            try:
                result = change(self._conn)
                self._conn.execute("COMMIT")
            except BaseException as exc:
                self._conn.execute("ROLLBACK")
                if isinstance(exc, sqlite3.OperationalError) and _is_busy(exc):
                    raise StoreBusyError(str(exc)) from exc
                raise
            return result

    def read_sync(self, query: Callable[[sqlite3.Connection], T]) -> T:
        with self._read_lock:
            return query(self._read_conn)

    async def write(self, change: Callable[[sqlite3.Connection], T]) -> T:
        return await anyio.to_thread.run_sync(partial(self.write_sync, change))

    async def read(self, query: Callable[[sqlite3.Connection], T]) -> T:
        return await anyio.to_thread.run_sync(partial(self.read_sync, query))

    def close(self) -> None:
        with self._lock:
            self._conn.close()
        if self._read_conn is not self._conn:
            with self._read_lock:
                self._read_conn.close()


def get_meta(conn: sqlite3.Connection, key: str) -> str | None:
    row = conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    return None if row is None else str(row["value"])


def set_meta(conn: sqlite3.Connection, key: str, value: str) -> None:
    conn.execute(
        "INSERT INTO meta (key, value) VALUES (?, ?) "
        "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        (key, value),
    )
