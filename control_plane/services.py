"""The control plane's parts for one running app, and the dependency that hands them to routes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from control_plane.catalog.registry import CatalogRegistry
from control_plane.consul_sync import ConsulSync
from control_plane.dns.server import DnsServer
from control_plane.drain.book import DrainBook
from control_plane.drain.envoy_reports import PeerReports
from control_plane.fleet.credentials import CredentialRegistry
from control_plane.fleet.drain_loop import DrainLoop
from control_plane.fleet.registry import Registry
from control_plane.keys import KeyRegistry
from control_plane.leadership import Leadership
from control_plane.model import Fleet
from control_plane.refusals import RefusalAudit
from control_plane.routing import PolicyRegistry
from control_plane.settings import Settings
from control_plane.store.base import Store
from control_plane.summaries import SummaryPublisher
from control_plane.tokens import TokenSet
from control_plane.xds.credentials import EnvoyCredentials
from control_plane.xds.server import XdsServer


@dataclass(frozen=True, slots=True)
class ControlPlane:
    settings: Settings
    tokens: TokenSet
    store: Store
    fleet: Fleet  # read by routes; changed only through the registry
    registry: Registry
    credentials: CredentialRegistry  # node credentials
    drains: DrainBook  # every node's drain sequence (read by routes)
    drain_loop: DrainLoop
    leadership: Leadership  # a LeaderLease between replicas on PostgreSQL
    peer_envoys: PeerReports  # the other replicas' Envoys, for the drains' Envoy step
    consul: ConsulSync | None  # with --consul, run by the lifespan
    keys: KeyRegistry
    routing: PolicyRegistry
    catalog: CatalogRegistry  # the model catalog
    summaries: SummaryPublisher
    refusals: RefusalAudit  # refused calls, in the log and the audit log (rate-limited)
    envoy_credentials: EnvoyCredentials  # who may open an xDS stream, for which snapshot
    xds: XdsServer | None = None  # the ADS server for Envoy, started by the lifespan
    dns: DnsServer | None = None  # the authoritative DNS, bound by the lifespan

    def begin_stop(self) -> None:
        """A stop has begun: new connections are refused while open ones finish. Nodes' silence
        from now on says nothing about them, so it must not take them out of the summaries
        (gateways would be sent an empty fleet just before we go); and gateways' blocking
        queries are answered now, with the fleet as it is, rather than cut off."""
        self.summaries.hold_health()
        self.summaries.feed.close()
        self.keys.feed.close()


async def get_services(request: Request) -> ControlPlane:
    services = request.app.state.services
    assert isinstance(services, ControlPlane), "app lifespan has not started"
    return services


ServicesDep = Annotated[ControlPlane, Depends(get_services)]
