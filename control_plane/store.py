"""The store: one transaction per change, on SQLite (embedded, the default) or PostgreSQL.

Every change runs as one function inside one transaction (its audit-log row included), so a
failure anywhere rolls the whole change back: nothing is half-written. Calls run in a worker
thread (`await store.write(fn)`), so the event loop never blocks on the database. The functions
take a `Connection` and write SQL both backends accept, with `?` placeholders. A write that cannot
get a lock within `busy_timeout_s` raises `StoreBusyError` (answered 503 with Retry-After): the
database is busy, not broken. A write names the kinds of state it changed (`changes`): on
PostgreSQL each is announced to the other replicas on commit (NOTIFY, see
`control_plane.replication`); SQLite has no other replicas. Both backends apply the one list of
migrations below at open and refuse a schema newer than this code.

SQLite (`SqliteStore`) runs in WAL mode: writes share one connection (serialized by a lock, each
`BEGIN IMMEDIATE`); reads have their own, so that they see the last commit and proceed while a
writer holds the database lock (another process's included). PostgreSQL is
`control_plane.store_postgres.PostgresStore`, chosen by a `postgresql://` URL (`open_store`).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from typing import Any, Protocol, TypeVar

import anyio.to_thread

logger = logging.getLogger(__name__)

T = TypeVar("T")
MEMORY_PATH = ":memory:"
POSTGRES_SCHEMES = ("postgresql://", "postgres://")

# The kinds of state a write changes: regions, nodes, drains, beats, keys, routing, credentials;
# a kind may carry which part changed after "=" (a health save: "beats=<oldest seen_at>"; a mint:
# "credentials=<node id>,...").
Changes = tuple[str, ...]
# PostgreSQL refuses a NOTIFY payload of 8,000 bytes or more: a longer list names none (read all).
MAX_NAMED_CHARS = 4000


def naming(kind: str, names: Sequence[str]) -> str:
    """`kind` announced with the `names` it changed, or alone if they would not fit."""
    joined = ",".join(names)
    return f"{kind}={joined}" if joined and len(joined) <= MAX_NAMED_CHARS else kind


Row = Any  # a mapping of column name to value (sqlite3.Row or psycopg's dict row)
Params = Sequence[object]


class Cursor(Protocol):
    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Row: ...

    def fetchall(self) -> list[Row]: ...

    def __iter__(self) -> Iterator[Row]: ...


class Connection(Protocol):
    """What a change or a query is given: one backend's connection inside its transaction."""

    def execute(self, sql: str, parameters: Params = (), /) -> Cursor: ...

    def executemany(self, sql: str, parameters: Iterable[Params], /) -> Cursor: ...


# One list for both backends, append only: migration N (1-based) moves a database from schema
# version N-1 to N. The SQL is what SQLite and PostgreSQL both accept; `{auto_id}` is each one's
# auto-increment key (SQLite keeps the types it was given before: DOUBLE PRECISION has REAL
# affinity, BIGINT INTEGER's).
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """CREATE TABLE regions (
            name TEXT PRIMARY KEY,
            lat DOUBLE PRECISION NOT NULL,
            lon DOUBLE PRECISION NOT NULL,
            ingress_url TEXT,
            weight DOUBLE PRECISION NOT NULL,
            state TEXT NOT NULL CHECK (state IN ('active', 'draining', 'disabled')),
            created_at DOUBLE PRECISION NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL
        )""",
        """CREATE TABLE nodes (
            node_id TEXT PRIMARY KEY,
            region TEXT NOT NULL,
            url TEXT NOT NULL,
            model TEXT NOT NULL,
            tp_size INTEGER NOT NULL,
            drain_requested INTEGER NOT NULL DEFAULT 0,
            registered_at DOUBLE PRECISION NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL
        )""",
        """CREATE TABLE api_keys (
            id TEXT PRIMARY KEY,
            name TEXT NOT NULL,
            tenant TEXT,
            secret_sha256 TEXT NOT NULL UNIQUE,
            rpm BIGINT NOT NULL,
            tpm BIGINT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            revoked_at DOUBLE PRECISION
        )""",
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
        """CREATE TABLE audit_log (
            id {auto_id},
            at DOUBLE PRECISION NOT NULL,
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
            started_at DOUBLE PRECISION NOT NULL,
            steps TEXT NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL
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
            created_at DOUBLE PRECISION NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL
        )""",
    ),
    (
        # The nodes that were beating, with their latest beat (control_plane/health_snapshot.py):
        # a restarted control plane keeps them healthy for a grace period.
        """CREATE TABLE node_health (
            node_id TEXT PRIMARY KEY,
            beat TEXT NOT NULL,
            seen_at DOUBLE PRECISION NOT NULL
        )""",
    ),
    (
        # Which replica leads the work that runs once (control_plane/leader.py; PostgreSQL only).
        """CREATE TABLE leader_lease (
            one INTEGER PRIMARY KEY CHECK (one = 1),
            holder TEXT NOT NULL,
            epoch BIGINT NOT NULL,
            backend_pid BIGINT NOT NULL,
            renewed_at DOUBLE PRECISION NOT NULL
        )""",
    ),
    (
        # What each replica's Envoys have ACKed of the drains in their `envoy` step
        # (control_plane/envoy_reports.py; PostgreSQL only).
        """CREATE TABLE xds_reports (
            replica_id TEXT PRIMARY KEY,
            report TEXT NOT NULL,
            reported_at DOUBLE PRECISION NOT NULL
        )""",
    ),
    (
        # Gateway PoPs' limit shares (control_plane/limit_reports.py): each PoP's default share
        # and last report, and per key in use each PoP's share, demand and buckets' levels.
        """CREATE TABLE limit_pops (
            pop TEXT PRIMARY KEY,
            default_share DOUBLE PRECISION NOT NULL,
            reported_at DOUBLE PRECISION NOT NULL
        )""",
        """CREATE TABLE limit_shares (
            key_id TEXT NOT NULL,
            pop TEXT NOT NULL,
            share DOUBLE PRECISION NOT NULL,
            demand DOUBLE PRECISION NOT NULL,
            demand_at DOUBLE PRECISION NOT NULL,
            need DOUBLE PRECISION NOT NULL,
            need_at DOUBLE PRECISION NOT NULL,
            request_level DOUBLE PRECISION,
            token_level DOUBLE PRECISION,
            levels_at DOUBLE PRECISION,
            PRIMARY KEY (key_id, pop)
        )""",
    ),
    (
        # Envoys' xDS credentials (control_plane/xds/credentials.py): the role and region a
        # token's ADS streams may ask for (region NULL for the edge).
        """CREATE TABLE envoy_credentials (
            name TEXT PRIMARY KEY,
            role TEXT NOT NULL CHECK (role IN ('ingress', 'edge')),
            region TEXT,
            secret_sha256 TEXT NOT NULL UNIQUE,
            created_at DOUBLE PRECISION NOT NULL
        )""",
    ),
)


def migration_sql(statement: str, auto_id: str) -> str:
    return statement.replace("{auto_id}", auto_id)


class StoreError(Exception):
    """The database cannot be used (unreachable, or written by a newer control plane)."""


class StoreBusyError(Exception):
    """Another connection held a lock the change needs for longer than the busy timeout."""


def check_schema_version(version: int) -> None:
    if version > len(MIGRATIONS):
        raise StoreError(
            f"database schema v{version} is newer than this control plane "
            f"(knows up to v{len(MIGRATIONS)})"
        )


class Store:
    """One backend's transactions; subclasses give `write_sync`, `read_sync` and the rest."""

    busy_timeout_s: float

    @property
    def is_writing(self) -> bool:
        """A change holds a write connection (running, or waiting for a lock)."""
        raise NotImplementedError

    @property
    def schema_version(self) -> int:
        raise NotImplementedError

    def write_sync(self, change: Callable[[Connection], T], changes: Changes = ()) -> T:
        """Run `change` in one transaction: all of it is committed, or none of it."""
        raise NotImplementedError

    def read_sync(self, query: Callable[[Connection], T]) -> T:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    async def write(self, change: Callable[[Connection], T], changes: Changes = ()) -> T:
        return await anyio.to_thread.run_sync(partial(self.write_sync, change, changes))

    async def read(self, query: Callable[[Connection], T]) -> T:
        return await anyio.to_thread.run_sync(partial(self.read_sync, query))


def is_postgres_url(db: str) -> bool:
    return db.startswith(POSTGRES_SCHEMES)


def open_store(db: str, busy_timeout_s: float = 5.0, replica_id: str = "") -> Store:
    """A SQLite file (or `:memory:`), or a PostgreSQL database given as a `postgresql://` URL
    (`replica_id` signs the changes it announces)."""
    if is_postgres_url(db):
        from control_plane.store_postgres import PostgresStore  # psycopg: an optional extra

        return PostgresStore(db, busy_timeout_s, replica_id)
    return SqliteStore(db, busy_timeout_s)


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    return exc.sqlite_errorcode in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


def _connect(path: str, busy_timeout_s: float) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.row_factory = sqlite3.Row
    conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000):d}")
    return conn


class SqliteStore(Store):
    def __init__(self, path: str, busy_timeout_s: float = 5.0) -> None:
        self.busy_timeout_s = busy_timeout_s
        self._lock = threading.Lock()
        try:
            self._conn = _connect(path, busy_timeout_s)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the SQLite database {path}: {exc}") from exc
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
        return self._lock.locked()

    @property
    def schema_version(self) -> int:
        with self._read_lock:
            return int(self._read_conn.execute("PRAGMA user_version").fetchone()[0])

    def _migrate(self) -> None:
        version = int(self._conn.execute("PRAGMA user_version").fetchone()[0])
        check_schema_version(version)
        for target, statements in enumerate(MIGRATIONS[version:], start=version + 1):
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                for statement in statements:
                    self._conn.execute(
                        migration_sql(statement, "INTEGER PRIMARY KEY AUTOINCREMENT")
                    )
                self._conn.execute(f"PRAGMA user_version = {target:d}")
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            logger.info("migrated store to schema v%d", target)

    def write_sync(self, change: Callable[[Connection], T], changes: Changes = ()) -> T:
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

    def read_sync(self, query: Callable[[Connection], T]) -> T:
        with self._read_lock:
            return query(self._read_conn)

    def close(self) -> None:
        with self._lock:
            self._conn.close()
        if self._read_conn is not self._conn:
            with self._read_lock:
                self._read_conn.close()


def get_meta(conn: Connection, key: str) -> str | None:
    row = conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    return None if row is None else str(row["value"])


def set_meta(conn: Connection, key: str, value: str) -> None:
    conn.execute(
        "INSERT INTO meta (key, value) VALUES (?, ?) "
        "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        (key, value),
    )
