"""Edits to the model catalog as pure functions: each takes the catalog as stored and returns the
catalog after the edit, checked, or raises the error the admin API answers with (409: a name
taken, a loop, a fallback to nothing, a name still referred to; 404: no such name)."""

from __future__ import annotations

from dataclasses import dataclass

from control_plane.errors import ConflictError, NotFoundError
from wire.model_catalog import (
    MAX_ALIASES,
    MAX_MODELS,
    CatalogAlias,
    CatalogError,
    CatalogModel,
    ModelCatalog,
    check_catalog,
)

Entry = CatalogModel | CatalogAlias


def lookup(catalog: ModelCatalog, name: str) -> Entry | None:
    """The model or alias called `name`, if there is one."""
    entries: list[Entry] = [*catalog.models, *catalog.aliases]
    return next((entry for entry in entries if entry.name == name), None)


def find(catalog: ModelCatalog, name: str) -> Entry:
    """The model or alias called `name`; 404 if there is none."""
    entry = lookup(catalog, name)
    if entry is None:
        raise NotFoundError(f"no model or alias is called {name!r}", "model_not_found")
    return entry


def add(catalog: ModelCatalog, entry: Entry) -> ModelCatalog:
    """`entry` added after the others of its kind."""
    if lookup(catalog, entry.name) is not None:
        raise ConflictError(f"the name {entry.name!r} is taken", "model_exists")
    if isinstance(entry, CatalogModel):
        return _checked((*catalog.models, entry), catalog.aliases)
    return _checked(catalog.models, (*catalog.aliases, entry))


@dataclass(frozen=True, slots=True)
class Patch:
    """What a PATCH changes (None: left as it is): a model's owner and fallbacks, or an alias's
    target (the one-call flip)."""

    owned_by: str | None = None
    fallbacks: tuple[str, ...] | None = None
    target: str | None = None


def change(catalog: ModelCatalog, name: str, patch: Patch) -> tuple[ModelCatalog, Entry]:
    """The catalog with `name` patched, and its entry after the patch (in place)."""
    current = find(catalog, name)
    if isinstance(current, CatalogAlias):
        if patch.owned_by is not None or patch.fallbacks is not None:
            raise ConflictError(f"{name!r} is an alias: only its target can change", "wrong_kind")
        alias = CatalogAlias(name=name, target=patch.target or current.target)
        aliases = tuple(alias if a.name == name else a for a in catalog.aliases)
        return _checked(catalog.models, aliases), alias
    if patch.target is not None:
        raise ConflictError(
            f"{name!r} is a model, not an alias: only its owned_by and fallbacks can change",
            "wrong_kind",
        )
    model = current.model_copy(
        update={
            "owned_by": patch.owned_by or current.owned_by,
            "fallbacks": current.fallbacks if patch.fallbacks is None else patch.fallbacks,
        }
    )
    models = tuple(model if m.name == name else m for m in catalog.models)
    return _checked(models, catalog.aliases), model


def remove(catalog: ModelCatalog, name: str) -> ModelCatalog:
    """The catalog without `name`; refused while an alias or a fallback names it."""
    find(catalog, name)
    named_by = referrers(catalog, name)
    if named_by:
        raise ConflictError(
            f"{name!r} is still named by {', '.join(named_by)}: point those elsewhere first",
            "model_in_use",
        )
    return _checked(
        tuple(m for m in catalog.models if m.name != name),
        tuple(a for a in catalog.aliases if a.name != name),
    )


def referrers(catalog: ModelCatalog, name: str) -> list[str]:
    """What names `name` directly: aliases pointing to it, models falling back to it."""
    found = [f"alias {a.name!r}" for a in catalog.aliases if a.target == name]
    found += [f"the fallbacks of {m.name!r}" for m in catalog.models if name in m.fallbacks]
    return found


def _checked(models: tuple[CatalogModel, ...], aliases: tuple[CatalogAlias, ...]) -> ModelCatalog:
    if len(models) > MAX_MODELS or len(aliases) > MAX_ALIASES:
        raise ConflictError(
            f"the catalog holds at most {MAX_MODELS} models and {MAX_ALIASES} aliases",
            "catalog_full",
        )
    try:
        check_catalog(models, aliases)
    except CatalogError as exc:
        raise ConflictError(str(exc), "catalog_conflict") from exc
    return ModelCatalog(models=models, aliases=aliases)
