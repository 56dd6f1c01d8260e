"""Nodes: heartbeats from node agents, and operators' credentials / move / drain / undrain /
remove."""

from __future__ import annotations

from fastapi import APIRouter, status

from control_plane.api.auth import AdminAuth, NodeAuth
from control_plane.drain.sequence import DrainSequence
from control_plane.errors import ERROR_RESPONSES, PermissionDeniedError
from control_plane.model import STEPS, Listed, Node, has_reached, is_listed
from control_plane.safe_text import SafePathName
from control_plane.schemas import (
    DrainStepView,
    DrainView,
    NodeCredentialCreate,
    NodeCredentialCreated,
    NodeList,
    NodePatch,
    NodeView,
    SafeName,
    view_from,
)
from control_plane.services import ControlPlane, ServicesDep
from control_plane.upstream_urls import URL_NOT_ALLOWED
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
    return view_from(DrainView, sequence, steps=steps)


def node_view(services: ControlPlane, node: Node) -> NodeView:
    view = view_of(node, services.summaries.listed)
    sequence = services.drains.sequences.get(node.node_id)
    if sequence is not None:
        view.drain = drain_view(sequence)
    return view


def view_of(node: Node, listed: Listed) -> NodeView:
    return NodeView(
        node_id=node.node_id,
        region=node.identity.region,
        url=node.identity.url,
        model=node.model,
        listed=is_listed(node.model, listed),
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
async def heartbeat(caller: NodeAuth, services: ServicesDep, beat: Heartbeat) -> HeartbeatReply:
    """A node's capacity report, with the node's own credential: only for the node id, region
    and URL it is bound to (403 otherwise). The reply carries the node's part of its drain
    sequence: stop admitting (`drain`), deregister from Consul (`consul_deregister`), exit
    (`may_exit`). (Beats from known nodes are answered by `fast_heartbeat` before they reach this
    route.)"""
    refusal = caller.credential.refusal(beat)
    if refusal is not None:
        raise refusal
    if caller.credential.url is None:  # this beat binds the node's URL: as if an operator gave it
        problem = services.settings.upstream_allowlist.problem(beat.url)
        if problem is not None:
            raise PermissionDeniedError(f"url {beat.url}: {problem}", URL_NOT_ALLOWED, "node")
    node = await services.registry.record_heartbeat(caller.actor, beat)
    return heartbeat_reply(services, node, beat)


def heartbeat_reply(services: ControlPlane, node: Node, beat: Heartbeat) -> HeartbeatReply:
    phase = node.drain_phase
    return HeartbeatReply(
        drain=node.drain_requested or phase is not None,
        heartbeat_interval_s=services.settings.heartbeat_interval_s,
        region_registered=beat.region in services.fleet.regions,
        drain_phase=phase,
        consul_deregister=has_reached(phase, "consul"),
        may_exit=has_reached(phase, "exit"),
    )


@router.get("")
async def list_nodes(actor: AdminAuth, services: ServicesDep) -> NodeList:
    nodes = sorted(services.fleet.nodes.values(), key=lambda n: n.node_id)
    return NodeList(nodes=[node_view(services, node) for node in nodes])


@router.get("/{node_id}")
async def get_node(actor: AdminAuth, services: ServicesDep, node_id: SafePathName) -> NodeView:
    """The node, with its drain sequence (phase, and when each step started and ended)."""
    return node_view(services, services.registry.get_node(node_id))


@router.post("/{node_id}/credential", status_code=status.HTTP_201_CREATED)
async def mint_credential(
    actor: AdminAuth, services: ServicesDep, node_id: SafeName, body: NodeCredentialCreate
) -> NodeCredentialCreated:
    """A node agent's own token (its MERIDIAN_NODE_TOKEN), bound to this node id and region (and
    URL, else its first heartbeat binds one). Shown only in this response; minting again
    replaces it."""
    services.settings.upstream_allowlist.check(body.url, "url")
    credentials = services.credentials
    credential, token = await credentials.mint(actor, node_id, body.region, body.url)
    return NodeCredentialCreated(
        node_id=node_id,
        region=credential.region,
        url=credential.url,
        created_at=credential.created_at,
        token=token,
    )


@router.patch("/{node_id}")
async def move_node(
    actor: AdminAuth, services: ServicesDep, node_id: SafePathName, patch: NodePatch
) -> NodeView:
    """Move a node to another region or URL (its heartbeats cannot): its registration and its
    credential change together, and routing follows at once. (A node that has not beaten yet:
    mint its credential again.)"""
    services.settings.upstream_allowlist.check(patch.url, "url")
    return node_view(services, await services.registry.update_node(actor, node_id, patch))


@router.post("/{node_id}/drain")
async def drain_node(actor: AdminAuth, services: ServicesDep, node_id: SafePathName) -> NodeView:
    """Start the node's drain sequence (idempotent): it stops admitting, leaves EDS, the
    summaries, DNS and Consul in that order, finishes what is in flight, and is told to exit."""
    return node_view(services, await services.registry.set_drain(actor, node_id, drain=True))


@router.post("/{node_id}/undrain")
async def undrain_node(actor: AdminAuth, services: ServicesDep, node_id: SafePathName) -> NodeView:
    """Cancel an operator's drain: the node is back in routing at once (unless its region is
    draining, or it drains on its own)."""
    return node_view(services, await services.registry.set_drain(actor, node_id, drain=False))


@router.delete("/{node_id}", status_code=status.HTTP_204_NO_CONTENT)
async def delete_node(actor: AdminAuth, services: ServicesDep, node_id: SafePathName) -> None:
    await services.registry.delete_node(actor, node_id)
