"""The picker's end of the nodes' cache event streams: a websocket listener that feeds the
exact cache index (region_picker/cache_index.py).

Each node streams over one connection at a time; a node that reconnects opens with a snapshot,
which makes the new connection the node's stream (what the old one still says is ignored, and
its end forgets nothing). A batch out of turn gets one `CacheResync` until the snapshot it asks
for arrives. When a node's stream ends its cache is forgotten (it was never seen to empty, but
nothing says what it holds any more), and `streams` is told, which holds the node out of the
picker's choices for a while: the likeliest reason is that it died.
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass
from http import HTTPStatus

import pydantic
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from region_picker.cache_index import CacheIndex
from region_picker.node_streams import NodeStreams
from wire.cache_events import (
    CACHE_EVENTS_PATH,
    MAX_FRAME_BYTES,
    MAX_SNAPSHOT_PARTS,
    CacheDelta,
    CacheResync,
    CacheSnapshot,
    parse_node_message,
)

logger = logging.getLogger(__name__)

# Close codes (RFC 6455): a frame that is not a valid message; a stream that changed its node.
_INVALID_DATA = 1007
_POLICY_VIOLATION = 1008


@dataclass(slots=True)
class ReceiverStats:
    num_connections: int = 0
    num_snapshots: int = 0
    num_deltas: int = 0
    num_gaps: int = 0  # batches out of turn, each answered with a resync
    num_invalid: int = 0  # connections closed for a bad frame
    num_refused: int = 0  # streams refused for want of the serving token


class CacheEventReceiver:
    def __init__(self, index: CacheIndex, streams: NodeStreams, token: str | None = None) -> None:
        self._index = index
        self._node_streams = streams
        # What a stream's `Authorization: Bearer` must say (None: nothing asked).
        self._authorization = None if token is None else f"Bearer {token}".encode()
        self._streams: dict[str, ServerConnection] = {}  # node id -> its current stream
        self.stats = ReceiverStats()

    async def serve(self, host: str, port: int) -> Server:
        """Listen on host:port (0: any free port; `Server.sockets` names it) until closed."""
        return await serve(
            self._handle, host, port, max_size=MAX_FRAME_BYTES, process_request=self._admit
        )

    def _admit(self, connection: ServerConnection, request: Request) -> Response | None:
        """Only the stream's path, and only from a node that presents the serving token."""
        if request.path != CACHE_EVENTS_PATH:
            return connection.respond(
                HTTPStatus.NOT_FOUND, f"only {CACHE_EVENTS_PATH} is served here\n"
            )
        expected = self._authorization
        if expected is None:
            return None
        presented = request.headers.get("Authorization", "").encode()
        if hmac.compare_digest(presented, expected):
            return None
        self.stats.num_refused += 1
        if self.stats.num_refused == 1:  # a node with the wrong token retries for ever
            logger.warning("cache events: a stream without the serving token refused")
        return connection.respond(HTTPStatus.UNAUTHORIZED, "the serving token is required\n")

    async def _handle(self, socket: ServerConnection) -> None:
        self.stats.num_connections += 1
        node_id: str | None = None
        awaiting_snapshot = False
        parts: list[CacheSnapshot] = []  # of a snapshot sent in parts, those taken so far
        try:
            async for frame in socket:
                try:
                    message = parse_node_message(frame)
                except pydantic.ValidationError as exc:
                    self.stats.num_invalid += 1
                    logger.warning("cache events from %s: bad frame: %s", node_id, exc)
                    await socket.close(_INVALID_DATA, "not a cache event message")
                    return
                if node_id is not None and message.node_id != node_id:
                    await socket.close(_POLICY_VIOLATION, "one stream carries one node")
                    return
                node_id = message.node_id
                if parts and not _continues(parts[0], message):
                    await socket.close(_POLICY_VIOLATION, "a snapshot's parts come together")
                    return
                if isinstance(message, CacheSnapshot) and message.more:
                    if len(parts) + 1 >= MAX_SNAPSHOT_PARTS:
                        await socket.close(_POLICY_VIOLATION, "a snapshot in too many parts")
                        return
                    parts.append(message)
                    continue
                if isinstance(message, CacheSnapshot):
                    if parts:
                        message = _joined([*parts, message])
                        parts = []
                    self._streams[node_id] = socket
                    self._index.apply_snapshot(message)
                    self._node_streams.opened(node_id)
                    self.stats.num_snapshots += 1
                    awaiting_snapshot = False
                    continue
                self.stats.num_deltas += 1
                is_ours = self._streams.get(node_id) is socket
                if (is_ours and self._index.apply_delta(message)) or awaiting_snapshot:
                    continue
                awaiting_snapshot = True
                self.stats.num_gaps += 1
                logger.info("cache events from %s: batch %d out of turn", node_id, message.seq)
                await socket.send(
                    CacheResync(reason=f"batch {message.seq} out of turn").model_dump_json()
                )
        except ConnectionClosed:
            pass  # the node went away; forgotten below
        finally:
            if node_id is not None and self._streams.get(node_id) is socket:
                del self._streams[node_id]
                self._index.forget(node_id)
                self._node_streams.lost(node_id)


def _continues(first: CacheSnapshot, message: CacheSnapshot | CacheDelta) -> bool:
    """Whether `message` is a further part of the snapshot `first` began."""
    return (
        isinstance(message, CacheSnapshot)
        and message.seq == first.seq
        and message.block_size == first.block_size
    )


def _joined(parts: list[CacheSnapshot]) -> CacheSnapshot:
    hashes = [h for part in parts for h in part.hashes]
    return parts[-1].model_copy(update={"hashes": hashes})
