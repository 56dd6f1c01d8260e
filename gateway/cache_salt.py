"""Per-tenant prefix-cache salts, so that a node's prefix cache is never shared across API keys.

A shared prefix cache is a timing side channel: a tenant whose prompt starts with another
tenant's cached prefix gets its first token sooner, and so learns that prefix was sent. Nodes
salt their engine's block hashes with the `x-meridian-cache-salt` header; the gateway sets it
from the API key, so requests of one key still share their own prefixes. Only the gateway may
choose a salt: a client that could name another key's salt could probe that key's cache, so the
client's header is never forwarded and a `cache_salt` field in its body is dropped.
"""

from __future__ import annotations

import functools
import hashlib

_DOMAIN = b"meridian prefix cache salt v1\x00"
SALT_HEX_CHARS = 32


@functools.lru_cache(maxsize=65_536)
def cache_salt_of(key_id: str) -> str:
    """The same salt for a key at every gateway (nodes are shared by all PoPs)."""
    return hashlib.sha256(_DOMAIN + key_id.encode()).hexdigest()[:SALT_HEX_CHARS]
