"""The one error contract of every Meridian HTTP service: OpenAI's error body and one code map.

Every error any hop answers (gateway, node agent, control plane) has the body
`{"error": {"message", "type", "param", "code"}}`, and its `type` follows from its status alone,
so a client reads the same 404 whichever hop said it. Each service keeps its own exception tree;
they all build their bodies here.
"""

from __future__ import annotations

import json
from typing import Final

from pydantic import BaseModel

# The two 401 codes of every service, for any credential (API key, serving token, admin, gateway
# or node token): no `Authorization` header (or an empty one), and one that holds no valid
# credential (another scheme, malformed, unknown, revoked).
MISSING_CREDENTIAL: Final = "missing_api_key"
INVALID_CREDENTIAL: Final = "invalid_api_key"

# status -> (type, the code used when the raiser names none)
STATUS_MAP: Final[dict[int, tuple[str, str]]] = {
    400: ("invalid_request_error", "invalid_request"),
    401: ("authentication_error", INVALID_CREDENTIAL),
    403: ("permission_error", "permission_denied"),
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    409: ("conflict_error", "conflict"),
    413: ("invalid_request_error", "body_too_large"),
    422: ("invalid_request_error", "validation_error"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    431: ("invalid_request_error", "headers_too_large"),
    499: ("client_closed_request", "client_closed_request"),
    500: ("server_error", "internal_error"),
    502: ("upstream_error", "upstream_error"),
    503: ("service_unavailable", "unavailable"),
    504: ("timeout_error", "timeout"),
}


def error_type(status: int) -> str:
    """The OpenAI `type` for a status; an unlisted one falls back by its class (4xx or 5xx)."""
    entry = STATUS_MAP.get(status)
    if entry is not None:
        return entry[0]
    return "invalid_request_error" if status < 500 else "server_error"


def default_code(status: int) -> str:
    entry = STATUS_MAP.get(status)
    if entry is not None:
        return entry[1]
    return "http_error"


def error_body(
    status: int, message: str, code: str | None = None, param: str | None = None
) -> dict[str, object]:
    return {
        "error": {
            "message": message,
            "type": error_type(status),
            "param": param,
            "code": code or default_code(status),
        }
    }


def error_json(
    status: int, message: str, code: str | None = None, param: str | None = None
) -> bytes:
    return json.dumps(error_body(status, message, code, param)).encode()


def route_error_message(status: int, method: str, path: str, reason: str) -> str:
    """What every hop says for a path it has no route for (404) or a wrong method (405); any
    other framework-raised error keeps its reason."""
    if status == 404:
        return f"Invalid URL ({method} {path})"
    if status == 405:
        return f"Method not allowed ({method} {path})"
    return reason


def route_error_code(status: int) -> str:
    return {404: "route_not_found"}.get(status, default_code(status))


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str


class ErrorBody(BaseModel):
    """The body as a schema, for services that publish OpenAPI."""

    error: ErrorDetail
