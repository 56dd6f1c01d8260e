"""The stored catalog: one document in the meta table, edited inside each edit's transaction
(read, edited, checked, audited and written together, so that two replicas' edits serialize), and
held in memory for the summaries."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

from control_plane import audit
from control_plane.audit import Actor
from control_plane.catalog import edits
from control_plane.catalog.edits import Entry, Patch
from control_plane.store.base import Connection, Store
from control_plane.store.meta_document import MetaDocument, load_document
from wire.model_catalog import CatalogModel, ModelCatalog

CATALOG_KEY: Final = "model_catalog"
KIND: Final = "models"  # what an edit announces to the other replicas

# An edit of the stored catalog: the catalog after it, and the entry it made (or removed).
Edit = Callable[[ModelCatalog], tuple[ModelCatalog, Entry]]
# An edit's audit detail from the entry before it (None: there was none) and the entry it made
# (for a delete: the entry removed).
Audited = Callable[[Entry | None, Entry], audit.AuditDetail]


def load_catalog(conn: Connection) -> ModelCatalog:
    return load_document(conn, CATALOG_KEY, ModelCatalog)


class CatalogRegistry:
    def __init__(
        self,
        store: Store,
        catalog: ModelCatalog,
        on_change: Callable[[], None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._document = MetaDocument(store, CATALOG_KEY, catalog, on_change)
        self._clock = clock  # a model's `created`

    @property
    def catalog(self) -> ModelCatalog:
        return self._document.current

    async def follow(self) -> None:
        """Another replica edited the catalog: read it."""
        await self._document.follow()

    async def add(self, actor: Actor, entry: Entry) -> Entry:
        """A new model (its `created` set now) or alias; 409 if its name is taken or it would
        not stand (an alias to nothing or in a loop, a fallback to nothing)."""
        if isinstance(entry, CatalogModel):
            entry = entry.model_copy(update={"created": int(self._clock())})
        added = entry

        def edit(catalog: ModelCatalog) -> tuple[ModelCatalog, Entry]:
            return edits.add(catalog, added), added

        return await self._write(actor, "create", entry.name, edit, _created)

    async def change(self, actor: Actor, name: str, patch: Patch) -> Entry:
        """A model's owner or fallbacks, or an alias's target (a rollout's flip), changed."""

        def edit(catalog: ModelCatalog) -> tuple[ModelCatalog, Entry]:
            return edits.change(catalog, name, patch)

        return await self._write(actor, "update", name, edit, _updated)

    async def remove(self, actor: Actor, name: str) -> None:
        """`name` gone; 409 while an alias or a fallback names it."""

        def edit(catalog: ModelCatalog) -> tuple[ModelCatalog, Entry]:
            return edits.remove(catalog, name), edits.find(catalog, name)

        await self._write(actor, "delete", name, edit, _deleted)

    async def _write(
        self, actor: Actor, verb: str, name: str, edit: Edit, audited: Audited
    ) -> Entry:
        def change(conn: Connection, stored: ModelCatalog) -> tuple[ModelCatalog, Entry]:
            catalog, entry = edit(stored)
            kind = "model" if isinstance(entry, CatalogModel) else "alias"
            detail = audited(edits.lookup(stored, name), entry)
            audit.record(conn, actor, f"{kind}.{verb}", name, detail)
            return catalog, entry

        return await self._document.replace(change, (KIND,))


def _created(before: Entry | None, after: Entry) -> audit.AuditDetail:
    return after.model_dump(mode="json")


def _updated(before: Entry | None, after: Entry) -> audit.AuditDetail:
    values = after.model_dump(mode="json")
    old = before.model_dump(mode="json") if before is not None else {}
    return values | {audit.OLD_KEY: audit.changed_from(old, values)}


def _deleted(before: Entry | None, after: Entry) -> audit.AuditDetail:
    return {audit.OLD_KEY: after.model_dump(mode="json")}
