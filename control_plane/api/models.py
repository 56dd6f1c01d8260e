"""The model catalog: operators list, add, change and remove models and aliases. A model's name
may hold '/' (`org/model`), so the routes take the rest of the path as the name."""

from __future__ import annotations

from fastapi import APIRouter, status

from control_plane.api.auth import AdminAuth
from control_plane.catalog import edits
from control_plane.catalog.edits import Entry
from control_plane.catalog.listing import entry_view, list_models
from control_plane.catalog.schemas import AliasView, ModelCreate, ModelList, ModelPatch, ModelView
from control_plane.errors import ERROR_RESPONSES
from control_plane.safe_text import SafePathName
from control_plane.services import ControlPlane, ServicesDep

router = APIRouter(prefix="/v1/models", tags=["models"], responses=ERROR_RESPONSES)


def _view(services: ControlPlane, entry: Entry) -> ModelView | AliasView:
    return entry_view(services.catalog.catalog, services.summaries.current.regions, entry)


@router.get("")
async def list_catalog(actor: AdminAuth, services: ServicesDep) -> ModelList:
    """Every catalog model with the regions serving it now (none: listed with 0 healthy nodes),
    the aliases, and the models nodes serve that the catalog does not list."""
    return list_models(
        services.catalog.catalog, services.summaries.current.regions, services.fleet.nodes.values()
    )


@router.post("", status_code=status.HTTP_201_CREATED)
async def create_entry(
    actor: AdminAuth, services: ServicesDep, body: ModelCreate
) -> ModelView | AliasView:
    """A model, or (with `target`) an alias. 409 if the name is taken, an alias would loop or
    lead nowhere, or a fallback names nothing."""
    return _view(services, await services.catalog.add(actor, body.entry()))


@router.get("/{name:path}")
async def get_entry(
    actor: AdminAuth, services: ServicesDep, name: SafePathName
) -> ModelView | AliasView:
    return _view(services, edits.find(services.catalog.catalog, name))


@router.patch("/{name:path}")
async def update_entry(
    actor: AdminAuth, services: ServicesDep, name: SafePathName, patch: ModelPatch
) -> ModelView | AliasView:
    """A model's fallbacks (the whole list) or owner; an alias's target: a rollout's flip,
    reaching gateways with the next summary."""
    return _view(services, await services.catalog.change(actor, name, patch.patch()))


@router.delete("/{name:path}", status_code=status.HTTP_204_NO_CONTENT)
async def delete_entry(actor: AdminAuth, services: ServicesDep, name: SafePathName) -> None:
    """Remove a model or alias; 409 while an alias or another model's fallbacks name it."""
    await services.catalog.remove(actor, name)
