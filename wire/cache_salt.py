"""The header that carries a request's prefix-cache salt from the gateway to the node (the
engine's `cache_salt`): the gateway sets it per API key, the node agent reads it; and the salt
the engine gets from it, which the region picker must derive the same way to hash a prompt as
the node's cache keys it."""

from __future__ import annotations

from typing import Final

CACHE_SALT_HEADER: Final = "x-meridian-cache-salt"


def engine_cache_salt(header: str | None, body_salt: str | None) -> str | None:
    """The engine's salt for a request with this header value and body `cache_salt`: each part
    tagged with where it came from, so that a client can split its tenant's partition further
    but no body salt reaches another tenant's partition, nor any header salt's. A header value
    cannot hold a newline, so the parts cannot be confused."""
    body = None if body_salt is None else f"body:{body_salt}"
    if header is None:
        return body
    return f"header:{header}" if body is None else f"header:{header}\n{body}"
