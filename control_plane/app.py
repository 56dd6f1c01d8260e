"""`create_app(settings)`: the FastAPI app, with a lifespan that owns the store and the sweep."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from control_plane import keys as key_store
from control_plane.api import (
    keys,
    limit_reports,
    models,
    nodes,
    region_nodes,
    regions,
    routing,
    status,
)
from control_plane.api import xds as xds_api
from control_plane.api.fast_heartbeat import HeartbeatFastPath
from control_plane.api.refused import install_refusal_handler
from control_plane.catalog.registry import CatalogRegistry, load_catalog
from control_plane.changes import ChangeFeed
from control_plane.consul_sync import ConsulSync, follow_consul
from control_plane.dns.server import DnsServer
from control_plane.drain.book import DrainBook
from control_plane.drain.envoy_reports import PeerReports, report_forever
from control_plane.drain.sequence import DrainSequence, DrainTimes
from control_plane.errors import error_response, install_error_handlers
from control_plane.fleet import health_snapshot
from control_plane.fleet.credentials import CredentialRegistry, NodeCredential, load_credentials
from control_plane.fleet.drain_loop import DrainLoop
from control_plane.fleet.health_snapshot import SAVE_EVERY_S, SAVE_EVERY_S_REPLICAS
from control_plane.fleet.registry import Registry
from control_plane.fleet.sql import FleetStore, load_drains, load_fleet, load_health
from control_plane.keys import KeyRegistry
from control_plane.leadership import Leadership, SoleLeader
from control_plane.model import Fleet
from control_plane.refusals import RefusalAudit, RefusalLimits
from control_plane.routing import PolicyRegistry, load_policy
from control_plane.services import ControlPlane
from control_plane.settings import Settings
from control_plane.store import open_store
from control_plane.store.base import Connection, Store, StoreBusyError, is_postgres_url
from control_plane.summaries import SummaryPublisher
from control_plane.tokens import TokenSet, resolve_tokens
from control_plane.xds.credentials import EnvoyCredentials
from control_plane.xds.server import ServerTls, XdsServer
from control_plane.xds.stream_gate import StreamGate
from wire.model_catalog import ModelCatalog
from wire.request_limits import RequestLimits
from wire.routing_policy import RoutingPolicy

logger = logging.getLogger(__name__)

API_VERSION = "1"
RETRY_AFTER_BUSY_S = 1

# What the lifespan reads from the store at start.
Loaded = tuple[Fleet, RoutingPolicy, ModelCatalog, int, list[DrainSequence], list[NodeCredential]]


def load(conn: Connection, settings: Settings) -> Loaded:
    """Everything the control plane keeps in memory, read in one transaction at start."""
    fleet = load_fleet(conn, settings.unhealthy_after_s)
    num_restored = health_snapshot.restore(
        load_health(conn), fleet, settings.restart_grace_s, time.monotonic()
    )
    if num_restored:
        logger.info(
            "%d nodes keep their last known health for %.1f s unless they beat",
            num_restored,
            settings.restart_grace_s,
        )
    policy, catalog, keys_index = load_policy(conn), load_catalog(conn), key_store.read_index(conn)
    return fleet, policy, catalog, keys_index, load_drains(conn), load_credentials(conn)


def build(
    settings: Settings,
    tokens: TokenSet,
    store: Store,
    loaded: Loaded,
    clock: Callable[[], float] = time.time,
    leadership: Leadership | None = None,
) -> ControlPlane:
    """The control plane's parts wired together (servers not started); `clock` is the drain
    sequence's (tests pass a fake one); `leadership` is the replicas' lease (None: this control
    plane always leads)."""
    fleet, policy, catalog, keys_index, drains, credentials = loaded
    # Summary indexes start from the wall clock in milliseconds, so they keep growing across
    # restarts (changes come far slower than 1,000 a second) and gateways see no index go back.
    summary_feed = ChangeFeed(int(time.time() * 1000))

    def publish_now() -> None:
        publisher.refresh()

    # The policy and the catalog travel in the summary document: a change is published at once.
    policies = PolicyRegistry(store, policy, on_change=publish_now)
    catalogs = CatalogRegistry(store, catalog, on_change=publish_now)
    publisher = SummaryPublisher(
        fleet, lambda: policies.policy, lambda: catalogs.catalog, summary_feed
    )
    refusals = RefusalAudit(
        store,
        RefusalLimits(settings.max_refusals_audited_per_address, settings.max_refusals_audited),
    )
    envoy_credentials = EnvoyCredentials(store)
    gate = StreamGate(envoy_credentials, refusals)
    xds = XdsServer(
        fleet,
        summary_feed,
        settings.sweep_interval_s,
        gate,
        lambda: publisher.listed,
        settings.pickers,
    )
    peer_envoys = PeerReports()
    has_consul = settings.consul_addr is not None
    times = DrainTimes.of(settings)
    book = DrainBook(fleet, publisher, xds, times, peer_envoys, has_consul, clock)
    book.restore(drains)
    leadership = leadership or SoleLeader()
    drains_noted = asyncio.Event()
    fleet_store, node_credentials = FleetStore(store), CredentialRegistry(store, credentials)
    registry = Registry(
        fleet_store, fleet, node_credentials, publisher, book, leadership, drains_noted
    )
    consul = None
    if settings.consul_addr is not None:
        consul = ConsulSync(
            settings.consul_addr, settings.consul_service_name, registry.apply_consul
        )
    drain_loop = DrainLoop(registry, book, fleet_store, leadership, drains_noted, consul)
    return ControlPlane(
        settings=settings,
        tokens=tokens,
        store=store,
        fleet=fleet,
        registry=registry,
        credentials=node_credentials,
        drains=book,
        drain_loop=drain_loop,
        leadership=leadership,
        peer_envoys=peer_envoys,
        consul=consul,
        keys=KeyRegistry(store, ChangeFeed(keys_index)),
        routing=policies,
        catalog=catalogs,
        summaries=publisher,
        refusals=refusals,
        envoy_credentials=envoy_credentials,
        xds=xds,
        dns=DnsServer(settings.dns, publisher),
    )


async def _on_store_busy(request: Request, exc: Exception) -> JSONResponse:
    # Another connection holds the database lock (a long transaction, a backup): nothing is
    # wrong with the request, and the same call shortly after will likely succeed.
    return error_response(
        503,
        "the control plane's database is busy; retry shortly",
        code="store_busy",
        headers={"Retry-After": str(RETRY_AFTER_BUSY_S)},
    )


def _xds_tls(settings: Settings) -> ServerTls | None:
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    return ServerTls(settings.tls_cert.read_bytes(), settings.tls_key.read_bytes())


def _leadership(settings: Settings) -> Leadership | None:
    """Replicas on PostgreSQL elect a leader; one control plane on SQLite always leads (None)."""
    if not is_postgres_url(settings.db_path):
        return None
    # Imported here: psycopg is needed on PostgreSQL only.
    from control_plane.replicas.leader_lease import LeaderLease

    return LeaderLease(settings.db_path, settings.replica_id, settings.leader_lease_s)


def _replica_tasks(services: ControlPlane) -> list[asyncio.Task[None]]:
    """On PostgreSQL: the leader lease, following the other replicas' changes, and reporting
    this replica's Envoys to the leader's drains."""
    settings = services.settings
    url = settings.db_path
    if not is_postgres_url(url):
        return []
    from control_plane.replicas.following import follow_changes
    from control_plane.replicas.leader_lease import LeaderLease

    lease = services.leadership
    assert isinstance(lease, LeaderLease) and services.xds is not None
    reports = report_forever(services.store, services.fleet, services.xds, settings.replica_id)
    return [
        asyncio.create_task(lease.run(services.drain_loop.take_lead), name="leader-lease"),
        asyncio.create_task(follow_changes(services, url, settings.replica_id)),
        asyncio.create_task(reports, name="envoy-reports"),
    ]


def create_app(settings: Settings) -> FastAPI:
    tokens = resolve_tokens(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = await anyio.to_thread.run_sync(
            open_store, settings.db_path, settings.db_busy_timeout_s, settings.replica_id
        )
        try:
            loaded = await store.read(lambda conn: load(conn, settings))
            services = build(settings, tokens, store, loaded, leadership=_leadership(settings))
            app.state.services = services
            xds = services.xds
            assert xds is not None
            await xds.start(settings.host, settings.xds_port, _xds_tls(settings))
            dns = services.dns
            assert dns is not None
            await dns.start(settings.host, settings.dns_port)
            sweep = asyncio.create_task(services.summaries.run(settings.sweep_interval_s))
            registry = services.registry
            draining = asyncio.create_task(services.drain_loop.run(settings.sweep_interval_s))
            replica_tasks = _replica_tasks(services)
            tasks = [sweep, draining, *replica_tasks]
            save_every_s = SAVE_EVERY_S_REPLICAS if replica_tasks else SAVE_EVERY_S
            tasks.append(asyncio.create_task(health_snapshot.save_forever(registry, save_every_s)))
            tasks.append(asyncio.create_task(services.refusals.run(), name="refusal-audit"))
            logger.info(
                "control plane ready: %d regions, %d nodes known",
                len(services.fleet.regions),
                len(services.fleet.nodes),
            )
            try:
                async with follow_consul(services.consul):
                    yield
            finally:
                for task in tasks:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                await registry.save_health()  # for the next start
                await xds.stop()
                dns.stop()
                services.summaries.feed.close()
                services.keys.feed.close()
                app.state.services = None
        finally:
            store.close()

    app = FastAPI(
        title="Meridian control plane",
        version=API_VERSION,
        summary="Fleet registry, admin API, heartbeats and region summaries.",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    install_error_handlers(app)
    install_refusal_handler(app)
    app.add_exception_handler(StoreBusyError, _on_store_busy)
    app.add_middleware(HeartbeatFastPath)
    # Added last, so it runs first: nothing reads a body or a token before the caps are checked.
    app.add_middleware(
        RequestLimits,
        max_body_bytes=settings.max_body_bytes,
        max_header_bytes=settings.max_header_bytes,
    )
    for router in (
        regions.router,
        region_nodes.router,
        nodes.router,
        keys.router,
        limit_reports.router,
        routing.router,
        models.router,
        status.router,
        xds_api.router,
    ):
        app.include_router(router)
    return app
