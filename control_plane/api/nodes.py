"""Nodes: heartbeats from node agents, and operators' drain / undrain / remove."""

from __future__ import annotations

from fastapi import APIRouter, status

from control_plane.auth import AdminAuth, NodeAuth
from control_plane.drain import STEPS, DrainSequence, has_reached
from control_plane.errors import ERROR_RESPONSES
from control_plane.fleet import Node
from control_plane.schemas import DrainStepView, DrainView, NodeList, NodeView
from control_plane.services import ControlPlane, ServicesDep
from wire.heartbeat import Heartbeat, HeartbeatReply

router = APIRouter(prefix="/v1/nodes", tags=["nodes"], responses=ERROR_RESPONSES)


def drain_view(sequence: DrainSequence) -> DrainView:
    steps = []
    for name in STEPS:
        record = sequence.steps.get(name)
        steps.append(
            DrainStepView(
                name=name,
                started_at=record.started_at if record else None,
                completed_at=record.completed_at if record else None,
                note=record.note if record else "",
            )
        )
    return DrainView(
        node_id=sequence.node_id,
        region=sequence.region,
        reason=sequence.reason,
        phase=sequence.phase,
        started_at=sequence.started_at,
        may_exit=sequence.may_exit,
        steps=steps,
    )


def node_view(services: ControlPlane, node: Node) -> NodeView:
    view = view_of(node)
    sequence = services.drains.sequences.get(node.node_id)
    if sequence is not None:
        view.drain = drain_view(sequence)
    return view


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
    """A node's capacity report. The reply carries the node's part of its drain sequence: stop
    admitting (`drain`), deregister from Consul (`consul_deregister`), exit (`may_exit`).
    (Beats from known nodes are answered by `fast_heartbeat` before they reach this route.)"""
    node = await services.registry.record_heartbeat(actor, beat)
    return heartbeat_reply(services, node, beat)


def heartbeat_reply(services: ControlPlane, node: Node, beat: Heartbeat) -> HeartbeatReply:
    phase = node.drain_phase
    return HeartbeatReply(
        drain=node.drain_requested or phase is not None,
        heartbeat_interval_s=services.settings.heartbeat_interval_s,
        region_registered=beat.region in services.registry.fleet.regions,
        drain_phase=phase,
        consul_deregister=has_reached(phase, "consul"),
        may_exit=has_reached(phase, "exit"),
    )


@router.get("")
async def list_nodes(actor: AdminAuth, services: ServicesDep) -> NodeList:
    nodes = sorted(services.registry.fleet.nodes.values(), key=lambda n: n.node_id)
    return NodeList(nodes=[node_view(services, node) for node in nodes])


@router.get("/{node_id}")
async def get_node(actor: AdminAuth, services: ServicesDep, node_id: str) -> NodeView:
    """The node, with its drain sequence (phase, and when each step started and ended)."""
    return node_view(services, services.registry.get_node(node_id))


@router.post("/{node_id}/drain")
async def drain_node(actor: AdminAuth, services: ServicesDep, node_id: str) -> NodeView:
    """Start the node's drain sequence (idempotent): it stops admitting, leaves EDS, the
    summaries, DNS and Consul in that order, finishes what is in flight, and is told to exit."""
    return node_view(services, await services.registry.set_drain(actor, node_id, drain=True))


@router.post("/{node_id}/undrain")
async def undrain_node(actor: AdminAuth, services: ServicesDep, node_id: str) -> NodeView:
    """Cancel an operator's drain: the node is back in routing at once (unless its region is
    draining, or it drains on its own)."""
    return node_view(services, await services.registry.set_drain(actor, node_id, drain=False))


@router.delete("/{node_id}", status_code=status.HTTP_204_NO_CONTENT)
async def delete_node(actor: AdminAuth, services: ServicesDep, node_id: str) -> None:
    await services.registry.delete_node(actor, node_id)
