"""The prefix key: one name for a system prompt at both levels of routing.

The gateway hashes a chat's system prompt (blake2b, 8 bytes, hex: gateway/openai_request.py)
and sends it upstream as PREFIX_KEY_HEADER. A node that serves the request remembers the key
and reports the keys it served lately in its heartbeats (`Heartbeat.hot_prefixes`); the control
plane counts them per model into the region's summary (`ModelLoad.hot_prefixes`), so the
gateway prefers a region whose nodes hold the prompt over one it merely hashes to. Inside the
region the picker still chooses the node by the prompt's exact block hashes: the key only says
which region's caches to go to.
"""

from __future__ import annotations

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
