"""Routes: the OpenAI API (`/v1/chat/completions`, `/v1/completions`, `/v1/models`), `/health`,
`/ready` and `/metrics`.

Order of refusal for a new request: a missing or wrong serving token (401, before the body is
read; auth.py), a malformed body (400, before the handler runs), an unknown model (404),
`resume_token_ids` from a caller not authenticated as a gateway (400), a bad cache-salt header
(400), not ready or draining (503), the waiting queue full (429), then the prompt's own problems
(400). A client that goes away aborts its request in the engine at once:
for streams, Starlette cancels the body when the ASGI receive reports the disconnect; otherwise
the generation races a watcher of the same event.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import suppress
from typing import Annotated, TypeVar

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import Receive

from node_agent.auth import is_gateway
from node_agent.cache_salt import cache_salt_of
from node_agent.errors import BadRequestError, ClientDisconnectedError
from node_agent.openai_schema import ChatCompletionRequest, CompletionRequest
from node_agent.request_ids import request_id_of
from node_agent.responses import JSON, TokenTexts
from node_agent.runtime import NodeRuntime
from node_agent.serving import PreparedRequest, Serving
from node_agent.streaming import (
    EventStreamResponse,
    Outputs,
    RequestRun,
    chat_events,
    collect_chat,
    collect_completion,
    completion_events,
)
from wire.deflection import ATTEMPT_COUNT_HEADER, attempt_of
from wire.prefix_key import PREFIX_KEY_HEADER

T = TypeVar("T")


def get_runtime(request: Request) -> NodeRuntime:
    runtime: NodeRuntime = request.app.state.runtime
    return runtime


Runtime = Annotated[NodeRuntime, Depends(get_runtime)]
router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, runtime: Runtime
) -> Response:
    return await _serve(request, runtime, body, Serving.prepare_chat, chat_events, collect_chat)


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request, runtime: Runtime) -> Response:
    prepare = Serving.prepare_completion
    return await _serve(request, runtime, body, prepare, completion_events, collect_completion)


Body = TypeVar("Body", ChatCompletionRequest, CompletionRequest)
Events = Callable[[RequestRun, Outputs, TokenTexts], AsyncIterator[bytes]]
Collect = Callable[[RequestRun, Outputs, TokenTexts], Awaitable[JSON]]


async def _serve(
    request: Request,
    runtime: NodeRuntime,
    body: Body,
    prepare: Callable[[Serving, Body, str | None], Awaitable[PreparedRequest]],
    events: Events,
    collect: Collect,
) -> Response:
    runtime.check_model(body.model)
    if body.resume_token_ids is not None and not is_gateway(request.scope):
        raise BadRequestError(
            "resume_token_ids is a gateway's field, for continuing its own streams: it is "
            "accepted only with the serving token",
            param="resume_token_ids",
        )
    cache_salt = cache_salt_of(request.headers, body.cache_salt)
    serving, ticket = runtime.admit(attempt_of(request.headers.get(ATTEMPT_COUNT_HEADER)))
    try:
        prepared = await prepare(serving, body, cache_salt)
    except BaseException:
        ticket.release()
        raise
    runtime.hot_prefixes.seen(request.headers.get(PREFIX_KEY_HEADER))
    timer = runtime.metrics.start_request()
    run = RequestRun(prepared, ticket, timer, request_id_of(request.scope))
    outputs = serving.outputs(prepared, ticket, run.timer)
    if body.stream:
        return EventStreamResponse(events(run, outputs, serving.texts), run.close)
    return await _respond(request, run, collect(run, outputs, serving.texts))


async def _respond(request: Request, run: RequestRun, work: Awaitable[JSON]) -> Response:
    try:
        body = await _unless_disconnected(request.receive, work)
    finally:
        run.close()
    return JSONResponse(body)


async def _unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientDisconnectedError (with `work` cancelled) if the client left."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task
        raise ClientDisconnectedError("the client closed the connection")
    finally:
        watcher.cancel()
        task.cancel()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


@router.get("/v1/models")
async def list_models(runtime: Runtime) -> JSON:
    return {"object": "list", "data": [_model_card(runtime)]}


@router.get("/v1/models/{model:path}")
async def get_model(model: str, runtime: Runtime) -> JSON:
    runtime.check_model(model)
    return _model_card(runtime)


def _model_card(runtime: NodeRuntime) -> JSON:
    card: JSON = {
        "id": runtime.model_name,
        "object": "model",
        "created": runtime.started_at,
        "owned_by": "meridian",
        "root": runtime.settings.model,
    }
    if runtime.llm is not None:
        card["max_model_len"] = runtime.llm.max_model_len
    return card


@router.get("/health")
async def health(runtime: Runtime) -> JSONResponse:
    """Alive: 200 unless the model failed to load, or the engine died or does not answer."""
    problem = runtime.health_problem()
    if problem is not None:
        return JSONResponse({"status": "dead", "reason": problem}, 503)
    return JSONResponse({"status": "ok"})


@router.get("/ready")
async def ready(runtime: Runtime) -> JSONResponse:
    """Ready: the model is loaded and the node is not draining."""
    reason = runtime.not_ready_reason()
    if reason is not None:
        return JSONResponse({"status": "not_ready", "reason": reason}, 503)
    return JSONResponse({"status": "ready", "model": runtime.model_name})


@router.get("/metrics")
async def metrics(runtime: Runtime) -> Response:
    return Response(runtime.metrics.render(), media_type=CONTENT_TYPE_LATEST)
