"""The control plane's exceptions, and the one place they become JSON error responses.

Every error body has the shape `{"error": {"message", "type", "param", "code"}}` (OpenAI's, built
by `wire.errors`), whatever
raised it: our own exceptions, request validation, unknown routes, or an unexpected bug (500).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from control_plane.safe_text import ERROR_TYPE as UNSAFE_CHARACTERS
from wire.errors import ErrorBody, error_body, route_error_code, route_error_message

logger = logging.getLogger(__name__)


# For OpenAPI: every route may answer with these, all in the `ErrorBody` shape. One status names
# the model (which puts its schema in the document's components) and the others refer to it:
# FastAPI builds a pydantic field per route for every status that names a model, when the route
# first serves (each field ~0.3 ms: nine made every app's first requests cost ~3 ms a route).
_ERROR_JSON = {
    "application/json": {"schema": {"$ref": f"#/components/schemas/{ErrorBody.__name__}"}}
}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"description": description}
    | ({"model": ErrorBody} if status == 400 else {"content": _ERROR_JSON})
    for status, description in (
        (400, "Body is not JSON, or a name holds control, format or separator characters"),
        (401, "Missing or unknown bearer token"),
        (403, "A valid token of the wrong kind, or a node's for another node, region or URL"),
        (404, "Not found"),
        (409, "Conflicts with the current state"),
        (413, "Body larger than max_body_bytes"),
        (422, "Invalid input"),
        (431, "Headers larger than max_header_bytes"),
        (503, "The database is busy (see Retry-After)"),
    )
}


class ControlPlaneError(Exception):
    status_code = 400

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class AuthenticationError(ControlPlaneError):
    status_code = 401


class PermissionDeniedError(ControlPlaneError):
    status_code = 403

    def __init__(self, message: str, code: str, presented: str) -> None:
        super().__init__(message, code)
        self.presented = presented  # the kind of the valid credential that was refused


class NotFoundError(ControlPlaneError):
    status_code = 404


class ConflictError(ControlPlaneError):
    status_code = 409


def error_response(
    status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, code), status_code=status, headers=headers)


def _describe_validation(exc: RequestValidationError) -> tuple[str, set[str]]:
    """One readable line per problem, and the problems' types."""
    parts: list[str] = []
    types: set[str] = set()
    for err in exc.errors():
        types.add(str(err.get("type")))
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{loc}: {err.get('msg', 'invalid')}" if loc else str(err.get("msg")))
    return "; ".join(parts) or "invalid request", types


def control_plane_error_response(exc: ControlPlaneError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else None
    return error_response(exc.status_code, exc.message, exc.code, headers)


async def _on_control_plane_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ControlPlaneError)
    return control_plane_error_response(exc)


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, types = _describe_validation(exc)
    if "json_invalid" in types:
        return error_response(400, "request body is not valid JSON", "invalid_json")
    if UNSAFE_CHARACTERS in types:
        return error_response(400, message, "invalid_characters")
    return error_response(422, message)


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    # A route's own 404 (an unknown region, say) carries its detail; the router's does not.
    message = (
        route_error_message(exc.status_code, request.method, request.url.path, exc.detail)
        if exc.detail in ("Not Found", "Method Not Allowed")
        else str(exc.detail)
    )
    return error_response(
        exc.status_code, message, route_error_code(exc.status_code), dict(exc.headers or {}) or None
    )


async def _on_unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(500, "internal error")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ControlPlaneError, _on_control_plane_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected_error)
