"""`create_app(settings, llm=...)`: the node agent's ASGI app.

The lifespan owns the engine (loaded in a thread after the server starts listening, so `/health`
answers while `/ready` says the model is loading), the one `httpx.AsyncClient`, the heartbeat
loop and the Consul registration. An engine passed in is used as is and left running at the end
(tests share one loaded model between apps); its weights' id comes with it (None: the node's
heartbeats carry no model identity).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI

from engine.async_engine import AsyncEngine
from node_agent.api import router
from node_agent.auth import ServingAuthMiddleware
from node_agent.cache_stream import stream_cache_events
from node_agent.consul import ConsulRegistration
from node_agent.errors import install_error_handlers
from node_agent.heartbeat import HeartbeatLoop, control_plane_client
from node_agent.request_ids import RequestIdMiddleware
from node_agent.runtime import NodeRuntime
from node_agent.settings import NodeAgentSettings
from wire.request_limits import RequestLimits

logger = logging.getLogger(__name__)


def create_app(
    settings: NodeAgentSettings, llm: AsyncEngine | None = None, weights_id: str | None = None
) -> FastAPI:
    runtime = NodeRuntime(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader: asyncio.Task[None] | None = None
        if llm is None:
            loader = asyncio.create_task(runtime.load(), name="engine-load")
        else:
            if not llm.is_running:
                llm.start()
            runtime.attach(llm, weights_id)
        consul = (
            ConsulRegistration(settings, runtime.node_id, runtime.model_name)
            if settings.consul
            else None
        )
        async with control_plane_client(settings) as client:
            heartbeat = HeartbeatLoop(runtime, client, consul)
            app.state.heartbeat = heartbeat
            beats = None
            if settings.control_plane or consul is not None:
                beats = asyncio.create_task(heartbeat.run(), name="heartbeat")
            cache_events = None
            if settings.picker_url is not None:
                cache_events = asyncio.create_task(
                    _stream_cache_events(runtime, loader), name="cache-events"
                )
            try:
                yield
            finally:
                await _stop(cache_events, beats, loader)
                await runtime.drain.close()
                if runtime.drain.is_draining:
                    await heartbeat.beat()  # tell the control plane at once that we are going
                if consul is not None:
                    await consul.deregister()
                if llm is None and runtime.llm is not None:
                    await runtime.llm.shutdown()

    app = FastAPI(title="Meridian node agent", lifespan=lifespan)
    app.state.runtime = runtime
    if settings.serving_token is not None:
        # Added first, so it runs inside the request-id middleware: refusals carry an id too.
        app.add_middleware(ServingAuthMiddleware, token=settings.serving_token.get_secret_value())
    # Outside the token check, so that no body is read before the caps are; inside the request
    # ids, so that a refusal carries one.
    app.add_middleware(
        RequestLimits,
        max_body_bytes=settings.max_body_bytes,
        max_header_bytes=settings.max_header_bytes,
    )
    app.add_middleware(RequestIdMiddleware, node_id=runtime.node_id)
    install_error_handlers(app)
    app.include_router(router)
    return app


async def _stream_cache_events(runtime: NodeRuntime, loader: asyncio.Task[None] | None) -> None:
    if loader is not None:
        await asyncio.wait([loader])  # not `await loader`: cancelling this must not cancel it
    settings = runtime.settings
    if runtime.llm is None or settings.picker_url is None:
        return  # the load failed: the node is stopping
    await stream_cache_events(
        runtime.llm,
        settings.picker_url,
        runtime.node_id,
        settings.cache_events_max_pending,
        runtime.model_name,
        runtime.metrics.registry,
        None if settings.serving_token is None else settings.serving_token.get_secret_value(),
    )


async def _stop(*tasks: asyncio.Task[None] | None) -> None:
    for task in tasks:
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
