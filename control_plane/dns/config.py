"""DNS settings: the zone we serve, answer TTL, region addresses, client subnets, shedding knobs.

Part of the control plane's `Settings` (field `dns`); from the environment as JSON, e.g.
`MERIDIAN_CP_DNS='{"hostname": "api.example.test", "zone": "example.test",
"client_subnets": {"10.1.0.0/16": "paris"}}'`.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, IPvAnyAddress, model_validator

from wire.geo import DEFAULT_CLIENT_SUBNETS, LOCATIONS, ClientLocator

DnsName = Annotated[
    str,
    Field(
        min_length=1,
        max_length=253,
        pattern=r"^([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$",
    ),
]
Share = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Seconds = Annotated[float, Field(ge=0.0, le=3600.0, allow_inf_nan=False)]


class PopEndpoint(BaseModel):
    """A gateway PoP the API name may resolve to, and where its health is checked."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str  # a place in wire/geo.py: where the PoP stands
    address: IPvAnyAddress
    health_url: Annotated[str, Field(pattern=r"^https?://\S+$")]

    @model_validator(mode="after")
    def _known_place(self) -> PopEndpoint:
        if self.name not in LOCATIONS:
            raise ValueError(f"dns.pops: {self.name!r} is not a place in wire/geo.py")
        return self


class DnsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # The zone we are authoritative for, and the API hostname in it that we steer.
    zone: DnsName = "meridian.test"
    hostname: DnsName = "api.meridian.test"
    # Short, so clients follow failover and shedding quickly; also the SOA's negative TTL.
    ttl_s: int = Field(default=5, ge=1, le=3600)
    # Answer addresses per region; a region not listed answers with its ingress URL's host when
    # that is an IP literal, and is left out of answers otherwise.
    region_addresses: dict[str, list[IPvAnyAddress]] = Field(default_factory=dict)
    # Client subnet → location name (wire/geo.py), merged over `DEFAULT_CLIENT_SUBNETS`.
    client_subnets: dict[str, str] = Field(default_factory=dict)
    # The address published for the zone's name server `ns1.<zone>` (default: the listen address,
    # or 127.0.0.1 when listening on all addresses).
    ns_address: IPvAnyAddress | None = None
    # Where a client outside every subnet is taken to be.
    default_location: str = "new-york"
    # Shedding: a saturated region answers this share of its clients (chosen by subnet hash)
    # with the next-nearest region that is not saturated.
    shed_share: Share = 0.5
    # A region enters shedding when its KV cache is fuller than the routing policy's
    # `saturation_threshold` or its queue delay exceeds `enter_queue_delay_s`; it leaves only once
    # KV use is below `saturation_threshold - leave_kv_margin` and the queue delay is below
    # `leave_queue_delay_s` (hysteresis: no flapping between the two marks).
    leave_kv_margin: Share = 0.1
    enter_queue_delay_s: Seconds = 5.0
    leave_queue_delay_s: Seconds = 2.0
    # Gateway PoPs: when listed, the hostname answers with the nearest healthy PoP (each one's
    # `health_url` checked every `pop_check_interval_s`; down after `pop_failures_down` failed
    # checks in a row, so a dead or draining PoP leaves the answers well within one TTL) instead
    # of the nearest region.
    pops: list[PopEndpoint] = Field(default_factory=list)
    pop_ca: str | None = None  # PEM CA file for https health URLs (default: the system's)
    pop_check_interval_s: float = Field(default=0.5, gt=0.0, le=60.0)
    pop_check_timeout_s: float = Field(default=1.0, gt=0.0, le=60.0)
    pop_failures_down: int = Field(default=2, ge=1, le=100)

    @model_validator(mode="after")
    def _consistent(self) -> DnsConfig:
        if self.hostname != self.zone and not self.hostname.endswith("." + self.zone):
            raise ValueError(f"dns.hostname {self.hostname!r} is not in dns.zone {self.zone!r}")
        if self.default_location not in LOCATIONS:
            raise ValueError(f"dns.default_location: unknown location {self.default_location!r}")
        if self.leave_queue_delay_s > self.enter_queue_delay_s:
            raise ValueError("dns.leave_queue_delay_s must not exceed dns.enter_queue_delay_s")
        names = [pop.name for pop in self.pops]
        if len(set(names)) != len(names):
            raise ValueError("dns.pops: PoP names must be unique")
        self.locator()  # a bad subnet or location name fails at start, with its name
        return self

    def locator(self) -> ClientLocator:
        return ClientLocator({**DEFAULT_CLIENT_SUBNETS, **self.client_subnets}, LOCATIONS)
