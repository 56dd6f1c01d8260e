"""The per-node load of one region (control plane → the region's picker), served as a blocking
query like the region summaries (`GET /v1/regions/{name}/nodes?index=N&wait=30s`).

A region summary adds its nodes up; the picker chooses among them, so it needs each routable
node's own queue and free KV, and the address Envoy reaches it at.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from wire.heartbeat import Name

REGION_NODES_SCHEMA_VERSION: Final = 1

Count = Annotated[int, Field(ge=0, le=2**62)]


class NodeLoad(BaseModel):
    """One routable node (healthy, in Envoy's routes, its model listed) as it last reported."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    node_id: Name
    url: str  # the node agent's URL, as in its heartbeats
    model: str  # the served name
    block_size: Annotated[int, Field(ge=1, le=2**20)]
    kv_blocks_total: Count
    kv_blocks_free: Count
    num_running: Count = 0
    num_waiting: Count = 0
    num_waiting_prefill_tokens: Count = 0
    num_running_prefill_tokens: Count = 0  # admitted, still to prefill
    # What the node measures (wire/heartbeat.py); None: not measured yet.
    prefill_tokens_per_s: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = None
    step_s: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = None


class RegionNodes(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    schema_version: Literal[1] = REGION_NODES_SCHEMA_VERSION
    index: Count
    region: Name
    nodes: tuple[NodeLoad, ...] = ()


# The picker's answer to Envoy: the chosen node's host:port, which the region's ingress routes
# on through an original-destination cluster (the Gateway API Inference Extension's header).
DESTINATION_HEADER: Final = "x-gateway-destination-endpoint"
