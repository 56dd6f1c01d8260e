"""Nodes: heartbeats from node agents, and operators' drain / undrain / remove."""

from __future__ import annotations

from fastapi import APIRouter, status

from control_plane.auth import AdminAuth, NodeAuth
from control_plane.errors import ERROR_RESPONSES
from control_plane.fleet import Node
from control_plane.schemas import NodeList, NodeView
from control_plane.services import ServicesDep
from wire.heartbeat import Heartbeat, HeartbeatReply

router = APIRouter(prefix="/v1/nodes", tags=["nodes"], responses=ERROR_RESPONSES)


def view_of(node: Node) -> NodeView:
    return NodeView(
        node_id=node.node_id,
        region=node.identity.region,
        url=node.identity.url,
        model=node.identity.model,
        tp_size=node.identity.tp_size,
        is_healthy=node.is_healthy,
        is_draining=node.is_draining,
        drain_requested=node.drain_requested,
        registered_at=node.registered_at,
        last_heartbeat_at=node.last_seen_unix,
        last_heartbeat=node.last_beat,
        sources=node.sources,
        consul_status=node.consul.status if node.consul is not None else None,
    )


@router.post("/heartbeat")
async def heartbeat(actor: NodeAuth, services: ServicesDep, beat: Heartbeat) -> HeartbeatReply:
    """A node's capacity report; the reply says whether an operator wants it to drain."""
    node = await services.registry.record_heartbeat(actor, beat)
    return HeartbeatReply(
        drain=node.drain_requested,
        heartbeat_interval_s=services.settings.heartbeat_interval_s,
        region_registered=beat.region in services.registry.fleet.regions,
    )


@router.get("")
async def list_nodes(actor: AdminAuth, services: ServicesDep) -> NodeList:
    nodes = sorted(services.registry.fleet.nodes.values(), key=lambda n: n.node_id)
    return NodeList(nodes=[view_of(node) for node in nodes])


@router.get("/{node_id}")
async def get_node(actor: AdminAuth, services: ServicesDep, node_id: str) -> NodeView:
    return view_of(services.registry.get_node(node_id))


@router.post("/{node_id}/drain")
async def drain_node(actor: AdminAuth, services: ServicesDep, node_id: str) -> NodeView:
    """Take the node out of routing now; it is told to drain in the reply to its next beat."""
    return view_of(await services.registry.set_drain(actor, node_id, drain=True))


@router.post("/{node_id}/undrain")
async def undrain_node(actor: AdminAuth, services: ServicesDep, node_id: str) -> NodeView:
    return view_of(await services.registry.set_drain(actor, node_id, drain=False))


@router.delete("/{node_id}", status_code=status.HTTP_204_NO_CONTENT)
async def delete_node(actor: AdminAuth, services: ServicesDep, node_id: str) -> None:
    await services.registry.delete_node(actor, node_id)
