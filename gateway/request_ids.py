"""Request ids: the client's `X-Request-Id` (if safe, wire/request_ids.py) or a new one; in every
log line.

The id is set in a context variable for the request's task, and a logging filter copies it into
each record (`%(request_id)s`), so every line logged while handling a request names it, and "-"
outside requests. It goes upstream in the same header and back to the client in the response.
"""

from __future__ import annotations

import contextvars
import logging

from wire.request_ids import HEADER, request_id_from

__all__ = ["HEADER", "RequestIdFilter", "current_request_id", "request_id_from"]

current_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


class RequestIdFilter(logging.Filter):
    """Adds `request_id` to every record that passes through the handler it is attached to."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = current_request_id.get()
        return True
