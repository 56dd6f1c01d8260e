"""The gateway's exceptions, and the one place they become OpenAI-style JSON error responses.

Every error body is `{"error": {"message", "type", "param", "code"}}` as OpenAI sends it; the
status carries the meaning (400 bad input, 401 bad key, 403 a model the key may not use, 404 an
unknown model, 413 too large, 429 rate limited, 502/503/504 when no region could answer).
"""

from __future__ import annotations

from aiohttp import web

from wire.errors import error_json


class GatewayError(Exception):
    status_code = 400

    def __init__(
        self,
        message: str,
        code: str,
        headers: dict[str, str] | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.headers = headers or {}
        self.param = param


class InvalidRequestError(GatewayError):
    status_code = 400


class BodyTooLargeError(GatewayError):
    status_code = 413


class AuthenticationError(GatewayError):
    status_code = 401


class ModelNotAllowedError(GatewayError):
    """The key may not use the model it asked for."""

    status_code = 403


class ModelNotFoundError(GatewayError):
    """No model or alias of that name is routed to."""

    status_code = 404


class RateLimitError(GatewayError):
    status_code = 429


class NotReadyError(GatewayError):
    """The gateway has not heard from the control plane yet (keys or regions unknown)."""

    status_code = 503


class NoCapacityError(GatewayError):
    """No region can take the request now."""

    status_code = 503


class UpstreamError(GatewayError):
    """Every region tried failed before answering."""

    status_code = 502


class DeadlineError(GatewayError):
    status_code = 504


def error_response(exc: GatewayError, headers: dict[str, str] | None = None) -> web.Response:
    all_headers = {**exc.headers, **(headers or {})}
    if exc.status_code == 401:
        all_headers.setdefault("www-authenticate", "Bearer")
    return web.Response(
        body=error_json(exc.status_code, exc.message, exc.code, exc.param),
        status=exc.status_code,
        content_type="application/json",
        headers=all_headers,
    )


def sse_error_event(status: int, message: str, code: str) -> bytes:
    """The event that ends a stream that failed after bytes were sent (then `[DONE]`)."""
    return b"data: " + error_json(status, message, code) + b"\n\ndata: [DONE]\n\n"
