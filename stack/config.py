"""The stack YAML: what `meridian up` runs (models, regions and their node agents per model,
ports), validated.

The default is `stack/default.yaml`; `meridian up --config FILE` reads another. Every key has a
default, so a file may hold only what it changes. Bad files fail with one line naming the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from control_plane.dns.config import DnsName
from stack.errors import StackConfigError
from stack.model_config import ModelConfig, catalog_of, one_model
from wire.geo import LOCATIONS, REGIONS
from wire.heartbeat import NAME_PATTERN
from wire.model_catalog import CatalogError, ModelCatalog, ModelName
from wire.validation import one_line

DEFAULT_CONFIG = Path(__file__).with_name("default.yaml")
DEFAULT_MODEL = "smollm2-135m-instruct"  # engine.model_store.DEFAULT_MODEL (not imported: torch)
MAX_NODES_PER_REGION = 16
MAX_POPS = 20
MAX_CP_REPLICAS = 5
MAX_MODELS = 50
DEFAULT_POPS = ("new-york", "london", "singapore")
DEFAULT_CLIENTS = ("tokyo", "paris", "chicago")

Port = Annotated[int, Field(ge=1, le=65535)]
RegionName = Annotated[str, Field(pattern=NAME_PATTERN, max_length=56)]
NodeCount = Annotated[int, Field(ge=1, le=MAX_NODES_PER_REGION)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RegionConfig(_Section):
    name: RegionName
    # Node agents per model, by the model's name in `models`.
    models: dict[ModelName, NodeCount] | None = Field(default=None, min_length=1)
    # The short form: this many node agents of the default model (neither: one).
    nodes: NodeCount | None = None
    # Where the region is; default: wire/geo.py's table (required for a name not in it).
    lat: float | None = Field(default=None, ge=-90.0, le=90.0)
    lon: float | None = Field(default=None, ge=-180.0, le=180.0)
    # The delay the RTT proxy adds between the gateway and this region; default: the RTT the
    # gateway itself expects from the shared location table (wire/geo.py `rtt_ms`).
    rtt_ms: float | None = Field(default=None, ge=0.0, le=2000.0)
    # Its endpoint picker (region_picker/) beside its Envoy: on, off; default: the stack's `picker`.
    picker: bool | None = None

    @model_validator(mode="after")
    def _located(self) -> RegionConfig:
        if (self.lat is None) != (self.lon is None):
            raise ValueError(f"region {self.name}: give both lat and lon, or neither")
        if self.lat is None and self.name not in REGIONS:
            raise ValueError(
                f"region {self.name} is not in wire/geo.py's table ({', '.join(REGIONS)}): "
                "give its lat and lon"
            )
        if self.models is not None and self.nodes is not None:
            raise ValueError(f"region {self.name}: give `models` or `nodes`, not both")
        if self.models is not None and sum(self.models.values()) > MAX_NODES_PER_REGION:
            raise ValueError(
                f"region {self.name}: {sum(self.models.values())} node agents, more than "
                f"{MAX_NODES_PER_REGION}"
            )
        return self

    def placement(self, default_model: str) -> dict[str, int]:
        """Node agents per model name (the short form's are the default model's)."""
        return self.models if self.models is not None else {default_model: self.nodes or 1}

    @property
    def location(self) -> tuple[float, float]:
        if self.lat is not None and self.lon is not None:
            return self.lat, self.lon
        place = REGIONS[self.name]
        return place.lat, place.lon


class NodeConfig(_Section):
    """Flags for every node agent (each one loads the model: keep the KV cache small)."""

    kv_cache_gib: float = Field(default=0.25, gt=0.0, le=1024.0)
    max_num_seqs: int = Field(default=16, ge=1, le=4096)
    # Torch threads per node agent; default: this machine's cores shared among the node agents.
    num_threads: int | None = Field(default=None, ge=1, le=1024)


def _known_places(names: list[str], what: str) -> list[str]:
    unknown = [name for name in names if name not in LOCATIONS]
    if unknown:
        raise ValueError(
            f"{what} {unknown[0]!r} is not a place in wire/geo.py (e.g. new-york, london, tokyo)"
        )
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"{what}s must be unique; repeated: {', '.join(repeated)}")
    return names


class EdgeConfig(_Section):
    """Edge node agents beside some PoPs, for light requests to the model alias `auto`."""

    pops: list[str] = Field(min_length=1, max_length=MAX_POPS)
    model: str = Field(default=DEFAULT_MODEL, min_length=1)
    # A light request asks for at most this many tokens (the classifier's threshold).
    max_tokens: int = Field(default=64, ge=1, le=100_000)
    # Its prompt has at most this many (estimated) tokens.
    max_prompt_tokens: int = Field(default=256, ge=1, le=1_000_000)
    # Requests one edge node takes at once; beyond that the edge is saturated (region instead).
    max_concurrency: int = Field(default=4, ge=1, le=4096)


class ApiKeyConfig(_Section):
    """The API key `up` creates for you (a fresh one each time)."""

    name: str = Field(default="meridian-up", min_length=1, max_length=100)
    rpm: int = Field(default=600, ge=1)
    tpm: int = Field(default=1_000_000, ge=1)


class ControlPlaneConfig(_Section):
    """The control plane's replicas, all on one database: one on SQLite (the default), or
    `replicas` on a PostgreSQL that `up` starts in the state directory (`db: postgres`)."""

    replicas: int = Field(default=1, ge=1, le=MAX_CP_REPLICAS)
    db: Literal["sqlite", "postgres"] = "sqlite"

    @model_validator(mode="after")
    def _replicas_share_postgres(self) -> ControlPlaneConfig:
        if self.replicas > 1 and self.db != "postgres":
            raise ValueError(
                f"{self.replicas} replicas need `db: postgres` (replicas share one database; "
                "SQLite is one process's)"
            )
        return self


class PortsConfig(_Section):
    """Everything listens on 127.0.0.1. Region i (from 0, in file order) uses `node_base +
    100*i + j` for its node j (as terraform/examples/local lays them out), `envoy_base + i` for
    its ingress Envoy, `envoy_admin_base + i` for that Envoy's admin, `rtt_proxy_base + i` for
    its delaying proxy."""

    control_plane: Port = 8080
    xds: Port = 18000
    dns: Port = 8053  # UDP
    # Every PoP's gateway listens on this port, PoP i on its own loopback address 127.0.1.(i+1)
    # (a DNS answer is an address: the port must be the same everywhere).
    gateway: Port = 8443
    # ... and serves its /metrics on this one, plain HTTP, on the same address.
    gateway_metrics: Port = 9464
    # The Anycast front: client city k listens on `anycast_base + k`; its admin HTTP on
    # `anycast_admin`.
    anycast_base: Port = 8601
    anycast_admin: Port = 8600
    # Client city k's public path straight to its nearest region (geo-DNS alone, no PoP; with
    # `simulate_rtt`): `direct_base + k`, a route of the RTT proxy.
    direct_base: Port = 10601
    redis: Port = 6390  # PoP i's redis-server (`limits: shared`): `redis + i`
    # PostgreSQL for `control_plane.db: postgres`; replica k (from 0) of the control plane
    # listens on `control_plane + k`, `xds + k` and `dns + k`.
    postgres: Port = 5433
    # Edge node agent beside PoP i: `edge_base + i`.
    edge_base: Port = 9501
    node_base: Port = 9001
    envoy_base: Port = 10001
    envoy_admin_base: Port = 10101
    rtt_proxy_base: Port = 10201
    # Region i's endpoint picker: ext_proc (gRPC, for its Envoy) on `picker_base + i`, /metrics
    # on `picker_metrics_base + i`, its nodes' cache event streams on `picker_events_base + i`.
    picker_base: Port = 10701
    picker_metrics_base: Port = 10801
    picker_events_base: Port = 10901


class PathsConfig(_Section):
    """The kinds of path the RTT proxy simulates (stack/path_delays.py): a PoP's path to a region
    rides the private backbone (steady); a client's own paths, to its PoP (the Anycast front)
    and straight to a region, are public."""

    # A public path: each chunk's mean extra one-way delay, as a share of the one-way time, and
    # the share of chunks that wait for a lost packet's retransmission (200 ms) per 100 ms of
    # the path's RTT.
    public_jitter_share: float = Field(default=0.05, ge=0.0, le=10.0)
    public_loss_per_100_ms: float = Field(default=0.005, ge=0.0, le=0.1)
    seed: int = 0  # the same seed, the same draws on every connection, run after run


class StackConfig(_Section):
    # What the fleet serves; each region's `models` places them. Without it, the short form: the
    # one model `model` (a pulled name or a path), which every node agent serves.
    models: list[ModelConfig] | None = Field(default=None, min_length=1, max_length=MAX_MODELS)
    # The default model (what `auto` means): a name from `models` (default: the first), or the
    # short form's one model.
    model: str | None = Field(default=None, min_length=1, max_length=4096)
    # Other names for models: alias → model (by name) or alias, registered in the catalog.
    aliases: dict[ModelName, ModelName] = Field(default_factory=dict)
    regions: list[RegionConfig] = Field(min_length=1, max_length=20)
    node: NodeConfig = Field(default_factory=NodeConfig)
    # Points of presence: one gateway process each, named for where it stands (wire/geo.py).
    pops: list[str] = Field(default=list(DEFAULT_POPS), min_length=1, max_length=MAX_POPS)
    # Simulated client cities: one Anycast front port each.
    clients: list[str] = Field(default=list(DEFAULT_CLIENTS), max_length=100)
    # The API's name, answered by the control plane's DNS with the nearest healthy PoP.
    dns_name: DnsName = "api.meridian.test"
    # A key's limits hold across PoPs either way (each PoP admits from its share, from the
    # control plane). shared: each PoP keeps its buckets in a redis-server of its own (when one
    # is installed), as every process of a real PoP would share them; local: in its gateway.
    limits: Literal["shared", "local"] = "shared"
    edge: EdgeConfig | None = None
    api_key: ApiKeyConfig = Field(default_factory=ApiKeyConfig)
    control_plane: ControlPlaneConfig = Field(default_factory=ControlPlaneConfig)
    ports: PortsConfig = Field(default_factory=PortsConfig)
    # auto: an ingress Envoy per region when `envoy` is installed (else a warning, and the node
    # agents are the ingresses); on: Envoy is required; off: never.
    envoy: Literal["auto", "on", "off"] = "auto"
    # Put a delaying TCP proxy in front of each region's ingress, so RTTs are felt, not only
    # computed (stack/rtt_proxy.py).
    simulate_rtt: bool = True
    paths: PathsConfig = Field(default_factory=PathsConfig)
    # An endpoint picker per region beside its Envoy (which it needs), choosing each request's
    # node by the prompt's cached prefix against load (docs/region_picker.md); off: Envoy
    # balances by least request. Each region's `picker` overrides it.
    picker: bool = False

    @field_validator("envoy", mode="before")
    @classmethod
    def _yaml_booleans(cls, value: object) -> object:
        # YAML 1.1 reads a bare `on`/`off` as true/false.
        if isinstance(value, bool):
            return "on" if value else "off"
        return value

    @field_validator("regions")
    @classmethod
    def _unique_names(cls, regions: list[RegionConfig]) -> list[RegionConfig]:
        names = [region.name for region in regions]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"region names must be unique; repeated: {', '.join(repeated)}")
        return regions

    @field_validator("pops")
    @classmethod
    def _known_pops(cls, pops: list[str]) -> list[str]:
        return _known_places(pops, "pop")

    @field_validator("clients")
    @classmethod
    def _known_clients(cls, clients: list[str]) -> list[str]:
        return _known_places(clients, "client city")

    @model_validator(mode="after")
    def _edges_at_pops(self) -> StackConfig:
        if self.edge is not None:
            _known_places(self.edge.pops, "edge pop")
            stray = [pop for pop in self.edge.pops if pop not in self.pops]
            if stray:
                raise ValueError(f"edge pop {stray[0]!r} is not one of `pops`")
        return self

    @model_validator(mode="after")
    def _models_placed(self) -> StackConfig:
        names = [model.name for model in self.fleet_models]
        for what, listed in (("model", names), ("served", [m.served for m in self.fleet_models])):
            repeated = sorted({name for name in listed if listed.count(name) > 1})
            if repeated:
                raise ValueError(f"{what} names must be unique; repeated: {', '.join(repeated)}")
        if self.models is not None and self.model is not None and self.model not in names:
            raise ValueError(f"model {self.model!r} is not one of `models` ({', '.join(names)})")
        for region in self.regions:
            unknown = [name for name in region.models or {} if name not in names]
            if unknown:
                raise ValueError(
                    f"region {region.name}: unknown model {unknown[0]!r} "
                    f"(`models` has {', '.join(names)})"
                )
        try:
            catalog_of(self.fleet_models, self.aliases)
        except CatalogError as exc:
            raise ValueError(str(exc)) from exc
        return self

    @property
    def fleet_models(self) -> list[ModelConfig]:
        """Every model the fleet serves (the short form's one)."""
        if self.models is not None:
            return self.models
        return [one_model(self.model or DEFAULT_MODEL)]

    @property
    def default_model(self) -> ModelConfig:
        if self.models is not None and self.model is not None:
            return self.model_named(self.model)
        return self.fleet_models[0]

    def model_named(self, name: str) -> ModelConfig:
        return next(model for model in self.fleet_models if model.name == name)

    def placement(self, region: RegionConfig) -> dict[str, int]:
        """The region's node agents per model name."""
        return region.placement(self.default_model.name)

    def has_picker(self, region: RegionConfig) -> bool:
        return self.picker if region.picker is None else region.picker

    def catalog(self) -> ModelCatalog:
        """The models and aliases as `up` registers them with the control plane."""
        return catalog_of(self.fleet_models, self.aliases)

    @property
    def num_nodes(self) -> int:
        """Node agents (each loads a model): the regions' and the edges'."""
        num_edges = len(self.edge.pops) if self.edge is not None else 0
        placed = sum(sum(self.placement(region).values()) for region in self.regions)
        return placed + num_edges


def parse_config(text: str, source: str = "<string>") -> StackConfig:
    """The stack config in `text` (YAML); StackConfigError says what is wrong in one line."""
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise StackConfigError(f"{source}: not valid YAML{where}") from exc
    if not isinstance(document, dict):
        raise StackConfigError(f"{source}: expected a mapping of settings at the top level")
    try:
        return StackConfig.model_validate(document)
    except ValidationError as exc:
        raise StackConfigError(f"{source}: {one_line(exc)}") from exc


def load_config(path: Path | None = None) -> StackConfig:
    """Read the stack YAML at `path` (default: the repository's `stack/default.yaml`)."""
    path = path or DEFAULT_CONFIG
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise StackConfigError(f"cannot read stack config {path}: {exc.strerror}") from exc
    return parse_config(text, str(path))
