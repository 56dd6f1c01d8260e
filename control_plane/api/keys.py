"""API keys: operators create (secret shown once), list, patch (models, limits per model, budget),
read the spend of and revoke; gateways watch a snapshot."""

from __future__ import annotations

from fastapi import APIRouter, Response, status

from control_plane.api.auth import AdminAuth, GatewayAuth
from control_plane.api.blocking import INDEX_HEADER_DOC, Index, Wait, indexed_json, wait_past
from control_plane.errors import ERROR_RESPONSES
from control_plane.key_schemas import KeyCreate, KeyCreated, KeyList, KeyPatch, KeySpend, KeyView
from control_plane.safe_text import SafePathName
from control_plane.services import ServicesDep
from wire.key_snapshot import KeySnapshot

router = APIRouter(prefix="/v1/keys", tags=["keys"], responses=ERROR_RESPONSES)


@router.get(
    "/snapshot",
    response_model=KeySnapshot,
    responses=INDEX_HEADER_DOC,
)
async def watch_keys(
    actor: GatewayAuth, services: ServicesDep, index: Index = 0, wait: Wait = "0s"
) -> Response:
    """Blocking query over the active keys' hashes and limits (same semantics as the region
    summary): a revoked key is missing from the next snapshot."""
    await wait_past(services.keys.feed, index, wait, services.settings.max_wait_s)
    snapshot = await services.keys.snapshot()
    return indexed_json(snapshot.model_dump_json(), snapshot.index)


@router.post("", status_code=status.HTTP_201_CREATED)
async def create_key(actor: AdminAuth, services: ServicesDep, body: KeyCreate) -> KeyCreated:
    """Create a key. The `secret` in this response is never shown again."""
    return await services.keys.create(actor, body)


@router.get("")
async def list_keys(actor: AdminAuth, services: ServicesDep) -> KeyList:
    return KeyList(keys=await services.keys.list())


@router.patch("/{key_id}")
async def patch_key(
    actor: AdminAuth, services: ServicesDep, key_id: SafePathName, body: KeyPatch
) -> KeyView:
    """Change the models a key may use, its limits per model or its token budget (a field given
    as null clears it); gateways apply it within about a second."""
    return await services.keys.patch(actor, key_id, body)


@router.get("/{key_id}/spend")
async def key_spend(actor: AdminAuth, services: ServicesDep, key_id: SafePathName) -> KeySpend:
    """The tokens the key spent in its current budget period (a key without a budget: the
    current UTC day), in all and per model, and what remains of its budget."""
    return await services.keys.spend(key_id)


@router.delete("/{key_id}", status_code=status.HTTP_204_NO_CONTENT)
async def revoke_key(actor: AdminAuth, services: ServicesDep, key_id: SafePathName) -> None:
    """Revoke a key; gateways watching the snapshot drop it within about a second."""
    await services.keys.revoke(actor, key_id)
