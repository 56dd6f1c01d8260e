"""`create_app(settings, metrics_sock)`: the gateway's aiohttp.web application, with a lifespan
(a cleanup context) that owns the one aiohttp client session (upstreams and control plane), the
rate limiter, the two watch loops and the metrics listener (on `metrics_sock`, if given).

Client and server are both aiohttp, chosen by measurement (docs/gateway.md): as a client, httpx
added 2-8x the latency of aiohttp and degraded badly with many concurrent streams; as a server,
uvicorn + Starlette cost about 60 us more CPU per proxied request than aiohttp.web.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web

from gateway.api import Handlers
from gateway.control_plane_client import ControlPlaneClient
from gateway.edge import AutoTier
from gateway.errors import GatewayError, error_response
from gateway.http_limits import cap_headers
from gateway.keys import KeyTable
from gateway.limit_reports import UsageReporter
from gateway.limit_shares import PopLimiter, ShareTable, UsageMeter
from gateway.limits import Buckets, LocalBuckets
from gateway.metrics import GatewayMetrics
from gateway.metrics_listener import MetricsListener
from gateway.model_list import ModelList
from gateway.proxy import Proxy
from gateway.region_ingress import with_region_ingress
from gateway.routing import Router, RouterConfig
from gateway.settings import GatewaySettings
from gateway.tls import control_plane_ssl
from gateway.watch import Watch
from wire.config_fields import config_from
from wire.control_plane_urls import ControlPlaneUrls
from wire.errors import error_json, route_error_code, route_error_message
from wire.geo import locate
from wire.key_snapshot import KeySnapshot
from wire.region_summary import RegionSummaryIndex

logger = logging.getLogger(__name__)

HANDLERS = web.AppKey("handlers", Handlers)

# How long start-up waits for the first keys and summaries before serving anyway (503 until).
FIRST_LOAD_WAIT_S = 5.0
# Seconds an idle upstream keep-alive connection is kept (node agents keep theirs for 5 s).
KEEPALIVE_S = 4.0


def _new_buckets(settings: GatewaySettings) -> Buckets:
    if settings.redis is None:
        return LocalBuckets()
    # Imported here: `redis` is an optional dependency, needed only for shared limits.
    from gateway.redis_limits import RedisBuckets

    return RedisBuckets(settings.redis, settings.redis_cooldown_s)


def _reporter(
    session: aiohttp.ClientSession, settings: GatewaySettings, limiter: PopLimiter
) -> UsageReporter:
    urls = ControlPlaneUrls.parse(settings.control_plane)  # its own: it fails over on its own
    client = ControlPlaneClient(session, urls, settings.gateway_token.get_secret_value())
    return UsageReporter(client, settings.pop, limiter, settings.limit_report_interval_s)


def _watches(
    session: aiohttp.ClientSession, settings: GatewaySettings, handlers: Handlers
) -> list[Watch[RegionSummaryIndex] | Watch[KeySnapshot]]:
    urls = ControlPlaneUrls.parse(settings.control_plane)  # one list: they fail over together
    client = ControlPlaneClient(session, urls, settings.gateway_token.get_secret_value())
    regions = Watch(
        client,
        "/v1/regions/summary",
        RegionSummaryIndex.model_validate_json,
        lambda document: handlers.router.update(
            with_region_ingress(document, settings.region_ingress)
        ),
        settings.watch_wait_s,
        settings.max_watch_backoff_s,
    )
    keys = Watch(
        client,
        "/v1/keys/snapshot",
        KeySnapshot.model_validate_json,
        handlers.keys.replace,
        settings.watch_wait_s,
        settings.max_watch_backoff_s,
    )
    return [regions, keys]


@web.middleware
async def openai_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Unknown routes, wrong methods and unexpected bugs, in OpenAI's error shape too."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = route_error_message(exc.status, request.method, request.path, exc.reason)
        body = error_json(exc.status, message, route_error_code(exc.status))
        return web.Response(body=body, status=exc.status, content_type="application/json")
    except GatewayError as exc:
        return error_response(exc)
    except Exception:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        body = error_json(500, "internal error")
        return web.Response(body=body, status=500, content_type="application/json")


def create_app(
    settings: GatewaySettings, metrics_sock: socket.socket | None = None
) -> web.Application:
    metrics = GatewayMetrics(settings.pop, settings.metrics_key_labels)
    metrics_listener = None
    if metrics_sock is not None:
        metrics_listener = MetricsListener(
            metrics_sock, metrics.render, settings.metrics_token, [openai_errors]
        )
    router = Router(config_from(RouterConfig, settings), locate(settings.pop))
    auto = None
    if settings.auto_model is not None:
        auto = AutoTier(settings, metrics.registry, router)
    handlers = Handlers(settings, KeyTable(), router, metrics, auto)

    async def lifespan(app: web.Application) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
        session = aiohttp.ClientSession(connector=connector)
        control_plane_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=control_plane_ssl(settings.control_plane_ca))
        )
        limiter = PopLimiter(_new_buckets(settings), ShareTable(), UsageMeter())
        watches = _watches(control_plane_session, settings, handlers)
        reporter = _reporter(control_plane_session, settings, limiter)
        tasks = [asyncio.create_task(loop.run()) for loop in (*watches, reporter)]
        loaded = [watch.loaded for watch in watches] + [reporter.loaded]
        handlers.proxy = Proxy(session, router, metrics, settings)
        handlers.limiter = limiter
        try:
            if metrics_listener is not None:
                await metrics_listener.start()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(FIRST_LOAD_WAIT_S):
                    await asyncio.gather(*(event.wait() for event in loaded))
            if not all(event.is_set() for event in loaded):
                logger.warning(
                    "no answer from the control plane at %s yet: serving 503 until there is",
                    settings.control_plane_url,
                )
            logger.info(
                "gateway %s ready: %d regions, %d keys",
                settings.pop,
                len(router.regions),
                len(handlers.keys),
            )
            # What start-up allocated lives as long as the process: keep it out of every
            # garbage collection from now on (measured: about 10% of the CPU per request).
            if settings.freeze_gc:
                gc.freeze()
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if metrics_listener is not None:
                await metrics_listener.stop()
            handlers.proxy = None
            handlers.limiter = None
            await limiter.close()
            await control_plane_session.close()
            await session.close()

    app = web.Application(
        client_max_size=settings.max_body_bytes,
        middlewares=[cap_headers(settings.max_header_bytes), openai_errors],
    )
    app[HANDLERS] = handlers
    app.cleanup_ctx.append(lifespan)
    app.router.add_post("/v1/chat/completions", handlers.chat)
    app.router.add_post("/v1/completions", handlers.completions)
    models = ModelList(handlers)
    app.router.add_get("/v1/models", models.list, allow_head=False)
    # Model names may hold `/` (`org/model-v2`).
    app.router.add_get("/v1/models/{model:.+}", models.retrieve, allow_head=False)
    app.router.add_get("/health", handlers.health, allow_head=False)
    return app
