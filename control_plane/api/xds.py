"""`/v1/xds`: what every connected Envoy was sent and accepted, for operators and drains (the
same view is the `xds` key of `GET /v1/status`); and Envoys' xDS credentials, minted, listed and
revoked by operators (`control_plane.xds.credentials`)."""

from __future__ import annotations

from fastapi import APIRouter, status

from control_plane.api.auth import AdminAuth
from control_plane.errors import ERROR_RESPONSES, ConflictError
from control_plane.safe_text import SafePathName
from control_plane.schemas import (
    SafeName,
    XdsCredentialCreate,
    XdsCredentialCreated,
    XdsCredentialList,
    XdsCredentialView,
    view_from,
)
from control_plane.services import ControlPlane, ServicesDep
from control_plane.xds.credentials import EnvoyCredential
from control_plane.xds.status import XdsStatus, status_of

router = APIRouter(prefix="/v1/xds", tags=["xds"], responses=ERROR_RESPONSES)


@router.get("")
async def get_xds_status(actor: AdminAuth, services: ServicesDep) -> XdsStatus:
    """Connected Envoys: per resource type the version sent, the version ACKed, NACK counts and
    the last NACK's message; plus the current snapshot versions and totals."""
    if services.xds is None:
        raise ConflictError("the xDS server is not running", "xds_not_running")
    return status_of(services.xds)


def _view_of(credential: EnvoyCredential) -> XdsCredentialView:
    return view_from(XdsCredentialView, credential)  # all but the secret's hash


async def _close_revoked_streams(services: ControlPlane) -> None:
    # This replica's streams at once; the others' when they hear of the change.
    if services.xds is not None:
        await services.xds.recheck()


@router.post("/credentials/{name}", status_code=status.HTTP_201_CREATED)
async def mint_credential(
    actor: AdminAuth, services: ServicesDep, name: SafeName, body: XdsCredentialCreate
) -> XdsCredentialCreated:
    """An Envoy's xDS token, for the ingress of `region` or for the edge: its ADS streams may ask
    for that snapshot only. Shown only in this response; minting again replaces it (streams that
    hold the old one are closed)."""
    credentials = services.envoy_credentials
    credential, token = await credentials.mint(actor, name, body.role, body.region)
    await _close_revoked_streams(services)
    return XdsCredentialCreated(**_view_of(credential).model_dump(), token=token)


@router.get("/credentials")
async def list_credentials(actor: AdminAuth, services: ServicesDep) -> XdsCredentialList:
    credentials = await services.envoy_credentials.list()
    return XdsCredentialList(credentials=[_view_of(c) for c in credentials])


@router.delete("/credentials/{name}", status_code=status.HTTP_204_NO_CONTENT)
async def delete_credential(actor: AdminAuth, services: ServicesDep, name: SafePathName) -> None:
    """Revoke an Envoy's xDS token: its streams are closed, its reconnections refused."""
    await services.envoy_credentials.delete(actor, name)
    await _close_revoked_streams(services)
