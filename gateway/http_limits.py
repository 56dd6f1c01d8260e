"""What the gateway refuses before a handler runs, in the OpenAI error shape.

- Headers larger than `max_header_bytes` in all are 431, the rule of every service
  (wire/request_limits.py). aiohttp's parser is told the same cap per line and per header, and
  what it refuses past it is 431 too.
- Anything else the parser refuses is 400. aiohttp's own answers to both were text/plain (and a
  header over its 8,190-byte default was a 400), logged with a traceback per bad request.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.typedefs import Handler, Middleware

from wire.errors import error_json
from wire.request_limits import header_bytes, headers_too_large

logger = logging.getLogger(__name__)


def _error(status: int, message: str) -> web.Response:
    response = web.Response(
        body=error_json(status, message), status=status, content_type="application/json"
    )
    response.force_close()
    return response


def cap_headers(max_header_bytes: int) -> Middleware:
    """The middleware that answers 431 to headers over the cap, before any handler runs."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if header_bytes(request.raw_headers) > max_header_bytes:
            return _error(431, headers_too_large(max_header_bytes))
        return await handler(request)

    return middleware


class GatewayRequestHandler(web.RequestHandler):
    """aiohttp's HTTP/1.1 protocol, with its errors answered in the OpenAI error shape."""

    def __init__(
        self,
        manager: web.Server,
        *,
        loop: asyncio.AbstractEventLoop,
        keepalive_timeout_s: float,
        max_header_bytes: int,
    ) -> None:
        super().__init__(
            manager,
            loop=loop,
            keepalive_timeout=keepalive_timeout_s,
            # The gateway writes its own line per request (aiohttp takes None for none).
            access_log=None,  # type: ignore[arg-type]
            max_line_size=max_header_bytes,
            max_field_size=max_header_bytes,
        )
        self._max_header_bytes = max_header_bytes

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:  # an answer has begun: the connection is broken
            raise ConnectionError("an answer was sent already; cannot send an error")
        if isinstance(exc, LineTooLong):
            return _error(431, headers_too_large(self._max_header_bytes))
        if isinstance(exc, HttpProcessingError):
            # A client's mistake (or a scanner's): not worth a traceback in the log.
            logger.debug("malformed request from %s: %s", request.remote, exc.message)
            return _error(400, f"malformed request: {exc.message}")
        logger.error("error handling a request from %s", request.remote, exc_info=exc)
        return _error(status, message or "internal error")
