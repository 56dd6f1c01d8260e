"""A document kept whole in the meta table (the routing policy, the model catalog): read at start,
replaced inside a write's own transaction, and held in memory in the store's commit order, also
when another replica replaced it (`follow`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

from pydantic import BaseModel, ValidationError

from control_plane.store.base import Changes, Connection, Store, StoreError, get_meta, set_meta

D = TypeVar("D", bound=BaseModel)
R = TypeVar("R")


def load_document(conn: Connection, key: str, cls: type[D]) -> D:
    """The stored document under `key`, or `cls()` if none was ever written."""
    stored = get_meta(conn, key)
    if stored is None:
        return cls()
    try:
        return cls.model_validate_json(stored)
    except ValidationError as exc:
        raise StoreError(f"the stored {key.replace('_', ' ')} is invalid: {exc}") from exc


class MetaDocument(Generic[D]):
    def __init__(
        self,
        store: Store,
        key: str,
        current: D,
        on_change: Callable[[], None],
    ) -> None:
        self._store = store
        self._key = key
        self._current = current
        self._on_change = on_change
        self._lock = asyncio.Lock()  # memory follows the store's commit order

    @property
    def current(self) -> D:
        return self._current

    def load(self, conn: Connection) -> D:
        return load_document(conn, self._key, type(self._current))

    def _hold(self, conn: Connection) -> None:
        """Lock the document's row until the transaction ends (writing it first if it was never
        written): on PostgreSQL another replica's replacement waits for this one's commit and
        then reads what it wrote, so that an edit made meanwhile is never lost (SQLite has one
        writer at a time anyway)."""
        conn.execute(
            "INSERT INTO meta (key, value) VALUES (?, ?) "
            "ON CONFLICT (key) DO UPDATE SET value = meta.value",
            (self._key, type(self._current)().model_dump_json()),
        )

    async def follow(self) -> None:
        """Another replica replaced the document: read it, unless a replacement made here is
        under way (it holds the lock from its write to memory: a read taken before its commit
        would undo it)."""
        async with self._lock:
            document = await self._store.read(self.load)
            if document != self._current:
                self._current = document
                self._on_change()

    async def replace(self, change: Callable[[Connection, D], tuple[D, R]], changes: Changes) -> R:
        """`change` gets the stored document (inside the write's transaction, where it also
        audits) and returns its replacement and a result; the replacement is stored, held, and
        announced to `on_change`."""

        def write(conn: Connection) -> tuple[D, R]:
            self._hold(conn)
            document, result = change(conn, self.load(conn))
            set_meta(conn, self._key, document.model_dump_json())
            return document, result

        async with self._lock:
            self._current, result = await self._store.write(write, changes)
        self._on_change()
        return result
