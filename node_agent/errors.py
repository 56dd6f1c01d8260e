"""The node agent's errors, and the one place they become OpenAI-shaped JSON responses.

Status codes: 400 for bad input (a prompt longer than the context is 400 with code
`context_length_exceeded`, as OpenAI answers, rather than 413), 404 for a model this node does not
serve, 429 with `Retry-After` while the waiting queue is over its bound (429 with
`x-meridian-deflected` when an early Envoy attempt is sent to another node, wire/deflection.py),
503 while the model loads, while draining, and once the engine has died (the gateway may retry
those elsewhere).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import EngineDeadError, InvalidRequestError
from wire.deflection import DEFLECTED_HEADER
from wire.errors import error_body, route_error_code, route_error_message

logger = logging.getLogger(__name__)


class NodeAgentError(Exception):
    """An error a client sees; subclasses fix the status and code (the status fixes the type)."""

    status_code = 500
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def headers(self) -> dict[str, str]:
        return {}


class BadRequestError(NodeAgentError):
    status_code = 400


class ContextLengthExceededError(BadRequestError):
    code = "context_length_exceeded"


class ModelNotFoundError(NodeAgentError):
    status_code = 404
    code = "model_not_found"


class OverloadedError(NodeAgentError):
    status_code = 429
    code = "overloaded"

    def __init__(self, message: str, *, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class DeflectedError(NodeAgentError):
    """Another request here is still waiting for its first token: Envoy tries another node."""

    status_code = 429
    code = "deflected"

    def headers(self) -> dict[str, str]:
        return {DEFLECTED_HEADER: "1"}


class UnavailableError(NodeAgentError):
    """The node cannot take requests now: loading, draining, or its engine is dead."""

    status_code = 503
    code = "unavailable"


class ClientDisconnectedError(NodeAgentError):
    """The client left before its answer was ready (nobody reads this response)."""

    status_code = 499


def to_response(exc: NodeAgentError) -> JSONResponse:
    return JSONResponse(
        error_body(exc.status_code, exc.message, exc.code, exc.param),
        status_code=exc.status_code,
        headers=exc.headers(),
    )


def from_engine(exc: Exception) -> NodeAgentError:
    """Map the engine's exceptions onto client-facing ones."""
    if isinstance(exc, InvalidRequestError):
        return BadRequestError(str(exc))
    if isinstance(exc, EngineDeadError):
        return UnavailableError(str(exc), code="engine_dead")
    return NodeAgentError(f"internal error: {type(exc).__name__}")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None, str]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None, "invalid_request"
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None  # the top-level field; the message names the full path
    kind = str(first.get("type", "invalid_request"))
    if kind == "json_invalid":
        return "the request body is not valid JSON", None, "invalid_json"
    detail = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    message = f"{'.'.join(loc)}: {detail}" if loc else detail
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more errors)"
    return message, param, kind


def install_error_handlers(app: FastAPI) -> None:
    async def on_node_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, NodeAgentError)
        return to_response(exc)

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        message, param, code = _validation_message(exc)
        return JSONResponse(error_body(400, message, code, param), status_code=400)

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        message = route_error_message(
            exc.status_code, request.method, request.url.path, str(exc.detail)
        )
        return JSONResponse(
            error_body(exc.status_code, message, route_error_code(exc.status_code)),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    async def on_engine_error(request: Request, exc: Exception) -> JSONResponse:
        return to_response(from_engine(exc))

    app.add_exception_handler(NodeAgentError, on_node_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(InvalidRequestError, on_engine_error)
    app.add_exception_handler(EngineDeadError, on_engine_error)
