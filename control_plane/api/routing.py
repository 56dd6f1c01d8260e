"""The routing policy gateways follow (also sent to them inside the region summary)."""

from __future__ import annotations

from fastapi import APIRouter

from control_plane.api.auth import AdminAuth
from control_plane.errors import ERROR_RESPONSES
from control_plane.services import ServicesDep
from wire.routing_policy import RoutingPolicy

router = APIRouter(prefix="/v1/routing", tags=["routing"], responses=ERROR_RESPONSES)


@router.get("")
async def get_routing(actor: AdminAuth, services: ServicesDep) -> RoutingPolicy:
    return services.routing.policy


@router.put("")
async def put_routing(
    actor: AdminAuth, services: ServicesDep, body: RoutingPolicy
) -> RoutingPolicy:
    """Replace the whole policy (fields left out take their defaults)."""
    return await services.routing.replace(actor, body)
