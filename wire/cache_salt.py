"""The header that carries a request's prefix-cache salt from the gateway to the node (the
engine's `cache_salt`): the gateway sets it per API key, the node agent reads it."""

from __future__ import annotations

from typing import Final

CACHE_SALT_HEADER: Final = "x-meridian-cache-salt"
