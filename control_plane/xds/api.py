"""`GET /v1/xds`: what every connected Envoy was sent and accepted, for operators and drains (the
same view is the `xds` key of `GET /v1/status`)."""

from __future__ import annotations

from fastapi import APIRouter

from control_plane.auth import AdminAuth
from control_plane.errors import ERROR_RESPONSES, ConflictError
from control_plane.services import ServicesDep
from control_plane.xds.status import XdsStatus, status_of

router = APIRouter(prefix="/v1/xds", tags=["xds"], responses=ERROR_RESPONSES)


@router.get("")
async def get_xds_status(actor: AdminAuth, services: ServicesDep) -> XdsStatus:
    """Connected Envoys: per resource type the version sent, the version ACKed, NACK counts and
    the last NACK's message; plus the current snapshot versions and totals."""
    if services.xds is None:
        raise ConflictError("the xDS server is not running", "xds_not_running")
    return status_of(services.xds)
