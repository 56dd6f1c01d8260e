"""The prefix key: one name for a system prompt at both levels of routing.

The gateway hashes a chat's system prompt (`prefix_key_of`, called by
gateway/openai_request.py) and sends it upstream as PREFIX_KEY_HEADER. The hash is keyed by the
request's prefix-cache salt (the tenant's, gateway/cache_salt.py): a node holds a tenant's
prompt for that tenant alone, so another tenant's same prompt must not be sent after it. A node
that serves the request remembers the key and reports the keys it served lately in its
heartbeats (`Heartbeat.hot_prefixes`); the control plane counts them per model into the
region's summary (`ModelLoad.hot_prefixes`), so the gateway prefers a region whose nodes hold
the prompt over one it merely hashes to. Inside the region the picker still chooses the node by
the prompt's exact block hashes: the key only says which region's caches to go to.
"""

from __future__ import annotations

import hashlib
import re
from typing import Annotated, Final

from pydantic import Field

PREFIX_KEY_HEADER: Final = "x-meridian-prefix-key"
PREFIX_KEY_PATTERN: Final = r"^[0-9a-f]{16}$"
# The most keys one heartbeat reports, and one model's digest in a region summary holds.
MAX_HOT_PREFIXES: Final = 64

PrefixKey = Annotated[str, Field(pattern=PREFIX_KEY_PATTERN)]

_KEY = re.compile(PREFIX_KEY_PATTERN)


def is_prefix_key(text: str | None) -> bool:
    """Whether `text` (a header's value) is a key as the gateway makes them."""
    return text is not None and _KEY.match(text) is not None


def prefix_key_of(system_prompt: str, cache_salt: str | None) -> str:
    """The key of a system prompt under a prefix-cache salt (None: caches shared by all)."""
    # surrogatepass: a lone surrogate is refused with a 400 later (`UpstreamBody.of`), not here.
    encoded = system_prompt.encode("utf-8", "surrogatepass")
    salt = b"" if cache_salt is None else cache_salt.encode()
    return hashlib.blake2b(encoded, digest_size=8, key=salt[:64]).hexdigest()
