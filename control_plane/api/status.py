"""Read-only views for operators: the whole fleet, and the audit log."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel

from control_plane import audit
from control_plane.api.auth import AdminAuth
from control_plane.api.nodes import drain_view, node_view
from control_plane.audit import AuditEntry
from control_plane.errors import ERROR_RESPONSES
from control_plane.model import is_listed
from control_plane.schemas import ReplicaView, StatusView
from control_plane.services import ServicesDep
from control_plane.store.base import Connection
from control_plane.xds.status import status_of

router = APIRouter(prefix="/v1", tags=["status"], responses=ERROR_RESPONSES)


class AuditPage(BaseModel):
    entries: list[AuditEntry]


@router.get("/status")
async def get_status(actor: AdminAuth, services: ServicesDep) -> StatusView:
    """The whole fleet: region summaries, nodes, every drain sequence, and xDS."""
    fleet = services.fleet
    summaries = services.summaries.current
    nodes = sorted(fleet.nodes.values(), key=lambda n: n.node_id)
    known = {node.identity.region for node in nodes}
    listed = services.summaries.listed
    unlisted = {node.model for node in nodes if not is_listed(node.model, listed)}
    leadership = services.leadership
    return StatusView(
        replica=ReplicaView(
            id=services.settings.replica_id,
            is_leader=leadership.is_leader,
            epoch=leadership.epoch,
        ),
        summary_index=summaries.index,
        keys_index=services.keys.feed.index,
        heartbeat_interval_s=services.settings.heartbeat_interval_s,
        unhealthy_after_s=services.settings.unhealthy_after_s,
        num_nodes=len(nodes),
        num_healthy_nodes=sum(node.is_healthy for node in nodes),
        num_draining_nodes=sum(node.is_draining for node in nodes),
        regions=summaries.regions,
        unregistered_regions=sorted(known - set(fleet.regions)),
        unlisted_models=sorted(unlisted),
        nodes=[node_view(services, node) for node in nodes],
        routing=summaries.routing,
        drains=[
            drain_view(sequence)
            for sequence in sorted(services.drains.sequences.values(), key=lambda s: s.started_at)
        ],
        xds=status_of(services.xds) if services.xds is not None else None,
    )


@router.get("/audit")
async def get_audit(
    actor: AdminAuth,
    services: ServicesDep,
    after_id: Annotated[int, Query(ge=0, le=2**62, description="return entries after this id")] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> AuditPage:
    """Audit entries oldest first; page by passing the last id seen as `after_id`."""

    def query(conn: Connection) -> list[AuditEntry]:
        return audit.list_entries(conn, after_id, limit)

    return AuditPage(entries=await services.store.read(query))
