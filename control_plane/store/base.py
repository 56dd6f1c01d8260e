"""What both backends implement: a `Store` of transactions, each given a `Connection`; their
errors; and what every table's code shares (the `meta` table, naming a change's parts)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio.to_thread

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T")
D = TypeVar("D", bound="DataclassInstance")
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


class StoreError(Exception):
    """The database cannot be used (unreachable, or written by a newer control plane)."""


class StoreBusyError(Exception):
    """Another connection held a lock the change needs for longer than the busy timeout."""


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


def get_meta(conn: Connection, key: str) -> str | None:
    row = conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    return None if row is None else str(row["value"])


def set_meta(conn: Connection, key: str, value: str) -> None:
    conn.execute(
        "INSERT INTO meta (key, value) VALUES (?, ?) "
        "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        (key, value),
    )


def of_row(cls: type[D], row: Row, **converted: object) -> D:
    """A `cls` (a dataclass) whose fields are the row's columns of the same names; `converted`
    gives those whose column needs converting (SQLite's 0/1 for a bool, an enum)."""
    columns = {f.name: row[f.name] for f in dataclasses.fields(cls) if f.name not in converted}
    return cls(**columns, **converted)
