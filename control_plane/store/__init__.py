"""The store: one transaction per change, on SQLite (embedded, the default) or PostgreSQL.

Every change runs as one function inside one transaction (its audit-log row included), so a
failure anywhere rolls the whole change back: nothing is half-written. Calls run in a worker
thread (`await store.write(fn)`), so the event loop never blocks on the database. The functions
take a `Connection` and write SQL both backends accept, with `?` placeholders. A write that cannot
get a lock within `busy_timeout_s` raises `StoreBusyError` (answered 503 with Retry-After): the
database is busy, not broken. A write names the kinds of state it changed (`changes`): on
PostgreSQL each is announced to the other replicas on commit (NOTIFY, see
`control_plane.replicas.following`); SQLite has no other replicas. Both backends apply the one
list of migrations (`migrations`) at open and refuse a schema newer than this code.

`base` is what both backends implement. SQLite (`sqlite.SqliteStore`) runs in WAL mode: writes
share one connection (serialized by a lock, each `BEGIN IMMEDIATE`); reads have their own, so that
they see the last commit and proceed while a writer holds the database lock (another process's
included). PostgreSQL is `control_plane.store.postgres.PostgresStore`, chosen by a `postgresql://`
URL (`open_store`).
"""

from __future__ import annotations

from control_plane.store.base import Store, is_postgres_url
from control_plane.store.sqlite import SqliteStore


def open_store(db: str, busy_timeout_s: float = 5.0, replica_id: str = "") -> Store:
    """A SQLite file (or `:memory:`), or a PostgreSQL database given as a `postgresql://` URL
    (`replica_id` signs the changes it announces)."""
    if is_postgres_url(db):
        from control_plane.store.postgres import PostgresStore  # psycopg: an optional extra

        return PostgresStore(db, busy_timeout_s, replica_id)
    return SqliteStore(db, busy_timeout_s)
