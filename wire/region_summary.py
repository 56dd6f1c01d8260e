"""Region summaries: control plane → gateways (`GET /v1/regions/summary?index=N&wait=30s`).

The envelope carries a monotonically increasing `index` (also in the `X-Meridian-Index` header): a
gateway passes the last index it saw and the control plane answers as soon as anything in the
envelope changes, or after `wait` with the same index (Consul blocking-query semantics). If the
index a gateway holds is ahead of the server's (a different control plane), it is answered at once
and should adopt the new index.

Version 2 makes the fleet model-aware: each region lists the models it serves (`models`, the
numbers of the nodes serving each), and the envelope carries the model catalog. A gateway reads
version 1 documents too (no models, no catalog: it routes model-blind, on the region totals).
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from wire.heartbeat import HttpUrlStr, Name
from wire.model_catalog import ModelCatalog
from wire.prefix_key import MAX_HOT_PREFIXES, PrefixKey
from wire.routing_policy import RoutingPolicy

REGION_SUMMARY_SCHEMA_VERSION: Final = 2

RegionState = Literal["active", "draining", "disabled"]
Latitude = Annotated[float, Field(ge=-90.0, le=90.0, allow_inf_nan=False)]
Longitude = Annotated[float, Field(ge=-180.0, le=180.0, allow_inf_nan=False)]
Weight = Annotated[float, Field(ge=0.0, le=1e6, allow_inf_nan=False)]


class QueueEstimate(BaseModel):
    """Work waiting in a region (sums over its routable nodes)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    num_waiting: int = Field(ge=0)
    num_waiting_prefill_tokens: int = Field(ge=0)
    # Admitted requests' prompt tokens still to prefill (0 from control planes that predate it).
    num_running_prefill_tokens: int = Field(default=0, ge=0)
    decode_tokens_per_s: float = Field(ge=0.0)
    # Seconds a new request can expect to wait before its prefill starts: the waiting prompt
    # tokens divided by the region's recent token throughput (see control_plane/summaries.py).
    expected_queue_delay_s: float = Field(ge=0.0)
    # The mean prefill rate, in prompt tokens per second per node, of the nodes that report one
    # (None: none does, or a control plane that predates it): what a gateway divides prompt
    # tokens by here, in place of its fleet-wide setting, where nodes differ.
    prefill_tokens_per_s: float | None = Field(default=None, gt=0.0)


class HotPrefix(BaseModel):
    """A system prompt the region's nodes served lately (wire/prefix_key.py), and how many of
    the model's nodes report it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    key: PrefixKey
    nodes: int = Field(ge=1)


class ModelLoad(BaseModel):
    """One routable model in a region: the numbers of the region's nodes serving it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: Annotated[str, Field(min_length=1, max_length=256)]  # the name its nodes serve it under
    # The distinct `ModelIdentity.serving_key`s of those nodes, sorted (empty: none reported).
    # Two regions continue each other's streams only when both hold exactly one and the same.
    serving_keys: tuple[str, ...] = ()
    context_length: int | None = Field(default=None, ge=1)  # the least over its nodes
    healthy_nodes: int = Field(ge=0)
    kv_blocks_free: int = Field(ge=0)
    kv_blocks_total: int = Field(ge=0)
    queue: QueueEstimate
    # The region's hot prefixes for this model: the keys its nodes report most, most nodes
    # first (then by key), at most MAX_HOT_PREFIXES. Empty from control planes that predate it.
    hot_prefixes: tuple[HotPrefix, ...] = Field(default=(), max_length=MAX_HOT_PREFIXES)


class RegionSummary(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    name: Name
    lat: Latitude
    lon: Longitude
    state: RegionState
    ingress_url: HttpUrlStr | None = None
    # Nodes whose heartbeats are current and that are not draining: the ones that take traffic.
    healthy_nodes: int = Field(ge=0)
    # Registered nodes the control plane counts unhealthy (beats missed, or Consul critical),
    # by node id, sorted: a gateway cuts a silent stream from one of them short (gateway/relay.py)
    # while the region's other nodes serve on. Empty from control planes that predate it.
    unhealthy_nodes: tuple[Name, ...] = ()
    kv_blocks_free: int = Field(ge=0)
    kv_blocks_total: int = Field(ge=0)
    queue: QueueEstimate
    # Operator's weight for this region (1.0 by default; 0 takes it out of weighted choices).
    weight: Weight
    # The routable models here, by name, sorted (version 2). The totals above are over all of
    # the region's nodes, whatever they serve.
    models: tuple[ModelLoad, ...] = ()


class RegionSummaryIndex(BaseModel):
    """The document a gateway watches."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    schema_version: Literal[1, 2] = REGION_SUMMARY_SCHEMA_VERSION
    index: int = Field(ge=0)
    regions: list[RegionSummary]
    # The operator's routing parameters, so a policy change reaches gateways the same way.
    routing: RoutingPolicy
    # The operator's model catalog (version 2; None from a control plane that predates it).
    catalog: ModelCatalog | None = None

    @property
    def is_model_aware(self) -> bool:
        return self.schema_version >= 2
