"""Request and response bodies of the admin API (the wire schemas shared with nodes and gateways
live in `wire/`)."""

from __future__ import annotations

from typing import Annotated, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from control_plane.model import ConsulStatus, NodeSource
from control_plane.picker_address import PickerAddress
from control_plane.safe_text import refuse_unsafe
from control_plane.upstream_urls import UpstreamUrl
from control_plane.xds.groups import Role
from control_plane.xds.status import XdsStatus
from wire.heartbeat import Heartbeat, Name
from wire.region_summary import Latitude, Longitude, RegionState, RegionSummary, Weight
from wire.routing_policy import RoutingPolicy

M = TypeVar("M", bound=BaseModel)


def view_from(view: type[M], source: object, **computed: object) -> M:
    """`view` with each field read from `source`'s attribute of the same name (a view of a
    dataclass); `computed` gives the fields `source` does not hold as the view shows them."""
    read = {name: getattr(source, name) for name in view.model_fields if name not in computed}
    return view.model_validate({**read, **computed})


# Path segments under /v1/regions that are routes, not region names.
RESERVED_REGION_NAMES = frozenset({"summary"})

# Free text shown to operators: one line, shown as it reads (control_plane/safe_text.py).
Label = Annotated[str, Field(min_length=1, max_length=128), BeforeValidator(refuse_unsafe)]
# A name an operator gives (a region, a node): unsafe characters get a 400 before the pattern.
SafeName = Annotated[Name, BeforeValidator(refuse_unsafe)]


class RegionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: SafeName
    lat: Latitude
    lon: Longitude
    ingress_url: UpstreamUrl | None = None
    weight: Weight = 1.0
    state: RegionState = "active"
    # Its endpoint picker beside its ingress Envoy: the Envoys ask it for each request's node.
    picker: PickerAddress | None = None

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, name: str) -> str:
        if name in RESERVED_REGION_NAMES:
            raise ValueError(f"{name!r} is reserved (it is a route under /v1/regions)")
        return name


class RegionPatch(BaseModel):
    """Fields to change; `ingress_url: null` or `picker: null` clears it. At least one field."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"minProperties": 1})

    # `SkipJsonSchema[None]`: a field may be left out, but only ingress_url and picker may be
    # null.
    lat: Latitude | SkipJsonSchema[None] = None
    lon: Longitude | SkipJsonSchema[None] = None
    ingress_url: UpstreamUrl | None = None
    weight: Weight | SkipJsonSchema[None] = None
    state: RegionState | SkipJsonSchema[None] = None
    picker: PickerAddress | None = None

    @model_validator(mode="after")
    def _not_empty(self) -> RegionPatch:
        if not self.model_fields_set:
            raise ValueError("give at least one of lat, lon, ingress_url, weight, state, picker")
        for name in ("lat", "lon", "weight", "state"):
            if name in self.model_fields_set and getattr(self, name) is None:
                raise ValueError(f"{name} cannot be null")
        return self


class RegionView(BaseModel):
    name: str
    lat: float
    lon: float
    ingress_url: str | None
    weight: float
    state: RegionState
    created_at: float
    updated_at: float
    is_deleting: bool = False  # DELETE asked: its nodes are draining, then it goes
    picker: str | None = None  # its endpoint picker, IP:PORT


class RegionList(BaseModel):
    regions: list[RegionView]


class DrainStepView(BaseModel):
    name: str  # admissions, envoy, summaries, dns, consul, in_flight, exit (in this order)
    started_at: float | None  # Unix seconds; None: not reached yet
    completed_at: float | None
    note: str  # how it ended, e.g. "out of EDS, ACKed by 2 Envoys", "timed out after 5.0 s: ..."


class DrainView(BaseModel):
    """A node's drain sequence (docs/control_plane.md, "The drain sequence")."""

    node_id: str
    region: str
    reason: str  # operator, region, or node (it reported draining on its own)
    phase: str  # the step under way, or "done"
    started_at: float
    may_exit: bool  # the node has been told it may exit
    steps: list[DrainStepView]


class NodeView(BaseModel):
    node_id: str
    region: str
    url: str
    model: str  # the name it serves its model under (its weights: `last_heartbeat`)
    # False while the catalog lists models and not this one: the node is in no route until the
    # operator lists it (an empty catalog lists every model).
    listed: bool
    tp_size: int
    is_healthy: bool  # the merge of heartbeats and Consul (control_plane/fleet.py)
    is_draining: bool  # asked to drain, or draining on its own
    drain_requested: bool  # asked to drain by an operator
    registered_at: float
    last_heartbeat_at: float | None  # Unix seconds at the control plane; None since (re)start
    last_heartbeat: Heartbeat | None
    sources: list[NodeSource]  # where we know it from: its heartbeats, Consul, or both
    consul_status: ConsulStatus | None  # None when Consul does not list it
    drain: DrainView | None = None  # its drain sequence, while it has one


class NodeList(BaseModel):
    nodes: list[NodeView]


class NodeCredentialCreate(BaseModel):
    """What a node's credential binds it to; a URL left out is bound by its first heartbeat."""

    model_config = ConfigDict(extra="forbid")

    region: SafeName
    url: UpstreamUrl | None = None


class NodeCredentialCreated(BaseModel):
    node_id: str
    region: str
    url: str | None
    created_at: float
    token: str = Field(
        description="the node's MERIDIAN_NODE_TOKEN; shown only in this response (minting "
        "again replaces it)"
    )


class NodePatch(BaseModel):
    """An operator's move of a node: to another region, or another URL. At least one field."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"minProperties": 1})

    region: SafeName | SkipJsonSchema[None] = None
    url: UpstreamUrl | SkipJsonSchema[None] = None

    @model_validator(mode="after")
    def _not_empty(self) -> NodePatch:
        if self.region is None and self.url is None:
            raise ValueError("give region, url or both (neither may be null)")
        return self


class XdsCredentialCreate(BaseModel):
    """What an Envoy's xDS credential binds its streams to: a role, and an ingress's region."""

    model_config = ConfigDict(extra="forbid")

    role: Role = Role.INGRESS
    region: SafeName | None = None

    @model_validator(mode="after")
    def _region_with_ingress(self) -> XdsCredentialCreate:
        if (self.region is None) != (self.role is Role.EDGE):
            raise ValueError("an ingress credential needs a region; an edge one takes none")
        return self


class XdsCredentialView(BaseModel):
    name: str
    role: Role
    region: str | None
    created_at: float


class XdsCredentialCreated(XdsCredentialView):
    token: str = Field(
        description="the Envoy's xDS token (`envoy-bootstrap --token-file`, or "
        "MERIDIAN_XDS_TOKEN); shown only in this response (minting again replaces it)"
    )


class XdsCredentialList(BaseModel):
    credentials: list[XdsCredentialView]


class ReplicaView(BaseModel):
    """This control plane among its replicas (one database, one leader)."""

    id: str
    is_leader: bool  # runs the drain sequences (always, on SQLite)
    epoch: int | None  # of the leader lease while leading on PostgreSQL


class StatusView(BaseModel):
    replica: ReplicaView
    summary_index: int
    keys_index: int
    heartbeat_interval_s: float
    unhealthy_after_s: float
    num_nodes: int
    num_healthy_nodes: int
    num_draining_nodes: int
    regions: list[RegionSummary]
    unregistered_regions: list[str]  # named by nodes' heartbeats but not registered
    unlisted_models: list[str]  # served by nodes, not in the catalog: routed to by no one
    nodes: list[NodeView]
    routing: RoutingPolicy
    drains: list[DrainView]  # every drain sequence, oldest first
    xds: XdsStatus | None  # what every connected Envoy was sent and accepted (as GET /v1/xds)
