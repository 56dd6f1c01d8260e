"""Which prefix-cache partition a request belongs to (the engine's `cache_salt`).

The gateway names the tenant in the `x-meridian-cache-salt` header; a client may also send
vLLM's `cache_salt` body field. The engine's salt tags each part with where it came from, and
with both it is both: a client can split its tenant's partition further, but no body salt
reaches another tenant's partition, nor any header salt's.
"""

from __future__ import annotations

from starlette.datastructures import Headers

from node_agent.errors import BadRequestError
from wire.cache_salt import CACHE_SALT_HEADER

MAX_CACHE_SALT_LEN = 1024


def cache_salt_of(headers: Headers, body_salt: str | None) -> str | None:
    header = headers.get(CACHE_SALT_HEADER)
    if header is not None and not 1 <= len(header) <= MAX_CACHE_SALT_LEN:
        raise BadRequestError(
            f"the {CACHE_SALT_HEADER} header must hold 1 to {MAX_CACHE_SALT_LEN} characters"
        )
    body = None if body_salt is None else f"body:{body_salt}"
    if header is None:
        return body
    # A header value cannot hold a newline, so the parts cannot be confused.
    return f"header:{header}" if body is None else f"header:{header}\n{body}"
