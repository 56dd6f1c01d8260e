"""Which prefix-cache partition a request belongs to (the engine's `cache_salt`).

The gateway names the tenant in the `x-meridian-cache-salt` header; a client may also send
vLLM's `cache_salt` body field; the engine's salt combines them (wire/cache_salt.py, shared
with the region picker, which hashes prompts as the engine will).
"""

from __future__ import annotations

from starlette.datastructures import Headers

from node_agent.errors import BadRequestError
from wire.cache_salt import CACHE_SALT_HEADER, engine_cache_salt

MAX_CACHE_SALT_LEN = 1024


def cache_salt_of(headers: Headers, body_salt: str | None) -> str | None:
    header = headers.get(CACHE_SALT_HEADER)
    if header is not None and not 1 <= len(header) <= MAX_CACHE_SALT_LEN:
        raise BadRequestError(
            f"the {CACHE_SALT_HEADER} header must hold 1 to {MAX_CACHE_SALT_LEN} characters"
        )
    return engine_cache_salt(header, body_salt)
