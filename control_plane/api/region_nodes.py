"""A region's routable nodes with their own load, for the region's picker (wire/region_nodes.py).

A blocking query whose index is a digest of the document: a node's own load can change while
the region's summary (its sums) stays the same, so the summaries' feed does not say when this
document changes. A watch re-reads the region's nodes when that feed moves, and at least every
sweep (the interval at which the control plane re-judges health), and answers once the digest
differs from the index it was given.
"""

from __future__ import annotations

import hashlib
import re
import time

from fastapi import APIRouter, Response

from control_plane.api.auth import GatewayAuth
from control_plane.api.blocking import INDEX_HEADER_DOC, Index, Wait, indexed_json
from control_plane.changes import parse_wait_s
from control_plane.errors import ERROR_RESPONSES, NotFoundError
from control_plane.model import Listed, Node, is_listed
from control_plane.safe_text import SafePathName
from control_plane.services import ControlPlane, ServicesDep
from wire.heartbeat import NAME_PATTERN
from wire.region_nodes import NodeLoad, RegionNodes

router = APIRouter(prefix="/v1/regions", tags=["regions"], responses=ERROR_RESPONSES)


def node_loads(nodes: list[Node], listed: Listed) -> tuple[NodeLoad, ...]:
    loads = []
    for node in sorted(nodes, key=lambda n: n.node_id):
        beat = node.last_beat
        if beat is None or not node.is_routable or not is_listed(node.model, listed):
            continue
        loads.append(
            NodeLoad(
                node_id=node.node_id,
                url=node.identity.url,
                model=node.model,
                block_size=beat.block_size,
                kv_blocks_total=beat.kv_blocks_total,
                kv_blocks_free=beat.kv_blocks_free,
                num_running=beat.num_running,
                num_waiting=beat.num_waiting,
                num_waiting_prefill_tokens=beat.num_waiting_prefill_tokens,
                num_running_prefill_tokens=beat.num_running_prefill_tokens,
                prefill_tokens_per_s=beat.prefill_tokens_per_s,
                step_s=beat.step_s,
            )
        )
    return tuple(loads)


def region_nodes(services: ControlPlane, region: str) -> RegionNodes:
    """The document now; a region not registered has no nodes (its picker waits)."""
    fleet = services.fleet
    nodes = fleet.nodes_in(region) if region in fleet.regions else []
    loads = node_loads(nodes, services.summaries.listed)
    digest = hashlib.blake2b(digest_size=8)
    for load in loads:
        digest.update(load.model_dump_json().encode())
    index = max(1, int.from_bytes(digest.digest(), "big") >> 2)  # 1..2**62, as Index allows
    return RegionNodes(index=index, region=region, nodes=loads)


@router.get("/{name}/nodes", response_model=RegionNodes, responses=INDEX_HEADER_DOC)
async def watch_region_nodes(
    actor: GatewayAuth,
    services: ServicesDep,
    name: SafePathName,
    index: Index = 0,
    wait: Wait = "0s",
) -> Response:
    """Blocking query: answers at once if the document's index differs from `index`, else
    waits for it to change or for `wait` to pass (then with the same index). A name no region
    can have is 404; a region not registered (yet) has no nodes."""
    if re.fullmatch(NAME_PATTERN, name) is None:
        raise NotFoundError(f"no region can be named {name!r}", "region_not_found")
    feed = services.summaries.feed
    deadline = time.monotonic() + parse_wait_s(wait, services.settings.max_wait_s)
    document = region_nodes(services, name)
    while (
        document.index == index
        and not feed.is_closed  # stopping: answer now, as the summaries' watches do
        and (left_s := deadline - time.monotonic()) > 0
    ):
        await feed.wait_past(feed.index, min(left_s, services.settings.sweep_interval_s))
        document = region_nodes(services, name)
    return indexed_json(document.model_dump_json(), document.index)
