"""SQLite, the default backend (see `control_plane.store`)."""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable

from control_plane.store.base import Changes, Connection, Store, StoreBusyError, StoreError, T
from control_plane.store.migrations import MIGRATIONS, check_schema_version, migration_sql

logger = logging.getLogger(__name__)

MEMORY_PATH = ":memory:"


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
