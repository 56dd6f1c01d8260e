"""The prefix-cache event stream: node agent → its region's picker, over one websocket.

Each message is one JSON text frame. The node opens the stream with a `CacheSnapshot` (every
block hash its prefix cache holds, as of batch `seq`; a cache of more than `MAX_SNAPSHOT_HASHES`
blocks goes in parts of that many, one frame each, `more` set on all but the last), then sends
one `CacheDelta` per batch of the engine's changes, numbered `seq + 1`, `seq + 2`, ... A
receiver that sees a number out of turn has missed a batch: it stops trusting what it knows of
the node and answers `CacheResync`; the node then sends a new snapshot (as it does on its own
when its outbound buffer overflowed). Hashes are the engine's block hashes
(engine/kv_cache_manager.py: 16 bytes, chained from the first block, salted per tenant) in
lower-case hex.
"""

from __future__ import annotations

import re
from typing import Annotated, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from wire.heartbeat import Name

CACHE_EVENTS_SCHEMA_VERSION: Final = 1
# The picker's websocket route for the stream.
CACHE_EVENTS_PATH: Final = "/v1/cache-events"
# The most hashes in one snapshot frame: 34 bytes a block in JSON, a million blocks in 34 MB.
MAX_SNAPSHOT_HASHES: Final = 1_000_000
# The most parts one snapshot may come in (64 million blocks): a receiver holds them until the
# last, so a stream that never ends one is cut off here.
MAX_SNAPSHOT_PARTS: Final = 64
MAX_FRAME_BYTES: Final = 64 * 2**20

_PICKER_URL = re.compile(
    rf"^(?P<scheme>https?|wss?)://(?P<host>[^\s/?#@]+)(/|{re.escape(CACHE_EVENTS_PATH)})?$"
)

BlockHashHex = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
Seq = Annotated[int, Field(ge=0, le=2**62)]


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    schema_version: Literal[1] = CACHE_EVENTS_SCHEMA_VERSION


class CacheSnapshot(_Message):
    """Everything the node's prefix cache holds after batch `seq`, or a part of it: with `more`,
    the next frame carries more of the same snapshot."""

    kind: Literal["snapshot"] = "snapshot"
    node_id: Name
    block_size: Annotated[int, Field(ge=1, le=2**16)]
    seq: Seq
    hashes: Annotated[list[BlockHashHex], Field(max_length=MAX_SNAPSHOT_HASHES)]
    more: bool = False


class CacheDelta(_Message):
    """Batch `seq`: the hashes that entered the prefix cache and those that left it."""

    kind: Literal["delta"] = "delta"
    node_id: Name
    seq: Annotated[int, Field(ge=1, le=2**62)]
    stored: list[BlockHashHex] = []
    removed: list[BlockHashHex] = []


class CacheResync(_Message):
    """The picker → the node: send a snapshot, what I know of your cache is incomplete."""

    kind: Literal["resync"] = "resync"
    reason: Annotated[str, Field(max_length=200)]


NodeMessage = Annotated[CacheSnapshot | CacheDelta, Field(discriminator="kind")]
_NODE_MESSAGE: TypeAdapter[CacheSnapshot | CacheDelta] = TypeAdapter(NodeMessage)


def parse_node_message(data: str | bytes) -> CacheSnapshot | CacheDelta:
    """One frame from a node; raises pydantic.ValidationError if it is neither message."""
    return _NODE_MESSAGE.validate_json(data)


def stream_url(picker_url: str) -> str:
    """The stream's websocket URL at a picker reached at `picker_url` (http(s) or ws(s), with or
    without the path)."""
    match = _PICKER_URL.match(picker_url)
    if match is None:
        raise ValueError(
            f"a picker URL is http(s)://HOST:PORT or ws(s)://HOST:PORT, not {picker_url!r}"
        )
    scheme = {"http": "ws", "https": "wss"}.get(match["scheme"], match["scheme"])
    return f"{scheme}://{match['host']}{CACHE_EVENTS_PATH}"
