"""The control plane's exceptions, and the one place they become JSON error responses.

Every error body has the shape `{"error": {"message", "type", "code"}}` (OpenAI's), whatever
raised it: our own exceptions, request validation, unknown routes, or an unexpected bug (500).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str


class ErrorBody(BaseModel):
    error: ErrorDetail


# For OpenAPI: every route may answer with these, all in the `ErrorBody` shape.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": description}
    for status, description in (
        (400, "Body is not JSON"),
        (401, "Missing or unknown bearer token"),
        (403, "A valid token of the wrong kind"),
        (404, "Not found"),
        (409, "Conflicts with the current state"),
        (422, "Invalid input"),
    )
}


class ControlPlaneError(Exception):
    status_code = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class AuthenticationError(ControlPlaneError):
    status_code = 401
    error_type = "authentication_error"


class PermissionDeniedError(ControlPlaneError):
    status_code = 403
    error_type = "permission_error"


class NotFoundError(ControlPlaneError):
    status_code = 404
    error_type = "not_found_error"


class ConflictError(ControlPlaneError):
    status_code = 409
    error_type = "conflict_error"


def error_response(
    status: int, message: str, error_type: str, code: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = ErrorBody(error=ErrorDetail(message=message, type=error_type, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _describe_validation(exc: RequestValidationError) -> tuple[str, bool]:
    """One readable line per problem, and whether the body was not JSON at all."""
    parts: list[str] = []
    is_bad_json = False
    for err in exc.errors():
        is_bad_json = is_bad_json or err.get("type") == "json_invalid"
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{loc}: {err.get('msg', 'invalid')}" if loc else str(err.get("msg")))
    return "; ".join(parts) or "invalid request", is_bad_json


async def _on_control_plane_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ControlPlaneError)
    headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else None
    return error_response(exc.status_code, exc.message, exc.error_type, exc.code, headers)


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, is_bad_json = _describe_validation(exc)
    if is_bad_json:
        return error_response(
            400, "request body is not valid JSON", "invalid_request_error", "invalid_json"
        )
    return error_response(422, message, "invalid_request_error", "validation_error")


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = {404: "route_not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(
        exc.status_code, str(exc.detail), error_type, code, dict(exc.headers or {}) or None
    )


async def _on_unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(500, "internal error", "server_error", "internal_error")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ControlPlaneError, _on_control_plane_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected_error)
