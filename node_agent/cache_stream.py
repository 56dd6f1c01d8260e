"""Streams the engine's prefix-cache events to the region's picker (wire/cache_events.py).

One websocket at a time, for as long as the node runs: each connection starts with a snapshot,
then carries the batches in order; the picker's `CacheResync` (it missed one) gets a snapshot
too. A lost or refused connection is retried with a doubling delay (with jitter, up to
`max_backoff_s`), and the next one starts with a snapshot again. Nothing here waits on the
engine or holds up serving: the engine's events go into a bounded buffer
(node_agent/cache_buffer.py) and only this task waits on the socket.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Iterator
from dataclasses import dataclass

import pydantic
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import WebSocketException

from engine.async_engine import AsyncEngine
from node_agent.cache_buffer import CacheEventBuffer, Delta, Snapshot
from node_agent.metrics import PREFIX
from wire.cache_events import (
    MAX_FRAME_BYTES,
    MAX_SNAPSHOT_HASHES,
    CacheDelta,
    CacheResync,
    CacheSnapshot,
    stream_url,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StreamTarget:
    """Where the stream goes and what it says about this node."""

    url: str  # ws(s)://host:port/v1/cache-events
    node_id: str
    block_size: int
    token: str | None = None  # the serving token, which the picker asks of a node's stream
    open_timeout_s: float = 5.0
    min_backoff_s: float = 0.1
    max_backoff_s: float = 5.0


class CacheEventStream:
    def __init__(self, target: StreamTarget, buffer: CacheEventBuffer) -> None:
        self._target = target
        self._buffer = buffer
        self.num_connections = 0
        self.is_connected = False

    async def run(self) -> None:
        """Connect, stream, reconnect: until cancelled."""
        target = self._target
        delay_s = target.min_backoff_s
        num_failures = 0  # in a row: the first is a warning, the retries are not news
        while True:
            try:
                async with connect(
                    target.url,
                    open_timeout=target.open_timeout_s,
                    max_size=MAX_FRAME_BYTES,
                    additional_headers=_authorization(target.token),
                ) as socket:
                    self._buffer.request_snapshot()
                    self.num_connections += 1
                    self.is_connected = True
                    delay_s, num_failures = target.min_backoff_s, 0
                    logger.info("streaming cache events to %s", target.url)
                    await self._exchange(socket)
            except (OSError, TimeoutError, WebSocketException) as exc:
                num_failures += 1
                level = logging.WARNING if num_failures == 1 else logging.DEBUG
                logger.log(level, "cache event stream to %s: %s; retrying", target.url, exc)
            finally:
                self.is_connected = False
            await asyncio.sleep(delay_s * random.uniform(0.5, 1.0))
            delay_s = min(delay_s * 2, target.max_backoff_s)

    async def _exchange(self, socket: ClientConnection) -> None:
        """Send and listen until either ends (the connection closed, or failed)."""
        tasks = {
            asyncio.create_task(self._send(socket), name="cache-events-send"),
            asyncio.create_task(self._listen(socket), name="cache-events-listen"),
        }
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in done:
            if not task.cancelled():
                task.result()  # raises what ended it

    async def _send(self, socket: ClientConnection) -> None:
        while True:
            message = self._buffer.next_message()
            if message is None:
                await self._buffer.wait()
            elif isinstance(message, Snapshot):
                # A whole cache's JSON takes a while: built off the event loop.
                target = self._target
                frames = await asyncio.to_thread(
                    snapshot_frames, target.node_id, target.block_size, message
                )
                for frame in frames:
                    await socket.send(frame)
            else:
                await socket.send(_delta_frame(self._target.node_id, message))

    async def _listen(self, socket: ClientConnection) -> None:
        async for frame in socket:
            try:
                resync = CacheResync.model_validate_json(frame)
            except pydantic.ValidationError:
                logger.warning("the picker sent an unknown message; ignored")
                continue
            logger.info("the picker asks for a snapshot: %s", resync.reason)
            self._buffer.request_snapshot()


def snapshot_frames(
    node_id: str, block_size: int, snapshot: Snapshot, max_hashes: int = MAX_SNAPSHOT_HASHES
) -> list[str]:
    """The snapshot's frames: its hashes in parts of at most `max_hashes` (at least one part,
    `more` on all but the last), so that no frame passes the picker's size limit."""
    hashes = [h.hex() for h in snapshot.hashes]
    starts = range(0, max(len(hashes), 1), max_hashes)
    return [
        CacheSnapshot.model_construct(
            node_id=node_id,
            block_size=block_size,
            seq=snapshot.seq,
            hashes=hashes[start : start + max_hashes],
            more=start + max_hashes < len(hashes),
        ).model_dump_json()
        for start in starts
    ]


def _delta_frame(node_id: str, delta: Delta) -> str:
    return CacheDelta.model_construct(
        node_id=node_id,
        seq=delta.seq,
        stored=[h.hex() for h in delta.events.stored],
        removed=[h.hex() for h in delta.events.removed],
    ).model_dump_json()


class StreamCollector(Collector):
    """The stream in the node's metrics, read when scraped."""

    def __init__(self, model_name: str, stream: CacheEventStream, buffer: CacheEventBuffer):
        self._labels = [model_name]
        self._stream = stream
        self._buffer = buffer

    def collect(self) -> Iterator[Metric]:
        connected = GaugeMetricFamily(
            PREFIX + "cache_events_connected",
            "Whether the prefix-cache event stream to the region's picker is connected (0 or 1).",
            labels=["model_name"],
        )
        connected.add_metric(self._labels, float(self._stream.is_connected))
        yield connected
        stats = self._buffer.stats
        for name, text, value in (
            ("connections", "Connections made to the picker", self._stream.num_connections),
            ("batches", "Batches of prefix-cache changes from the engine", stats.num_batches),
            (
                "snapshots",
                "Snapshots sent (each connection, resync or overflow)",
                stats.num_snapshots,
            ),
            (
                "overflows",
                "Times a slow picker made the queue drop for a snapshot",
                stats.num_overflows,
            ),
        ):
            family = CounterMetricFamily(
                f"{PREFIX}cache_events_{name}", text, labels=["model_name"]
            )
            family.add_metric(self._labels, value)
            yield family


def _authorization(token: str | None) -> dict[str, str]:
    return {} if token is None else {"Authorization": f"Bearer {token}"}


async def stream_cache_events(
    llm: AsyncEngine,
    picker_url: str,
    node_id: str,
    max_pending_batches: int,
    model_name: str,
    registry: CollectorRegistry,
    token: str | None = None,
) -> None:
    """Watch `llm`'s prefix cache and stream it to the picker at `picker_url` (presenting
    `token`, the node's serving token), until cancelled; the stream's counts go to the node's
    metrics `registry`."""
    buffer = CacheEventBuffer(max_pending_batches)
    llm.watch_cache(buffer.apply)
    block_size = llm.stats().block_size
    target = StreamTarget(stream_url(picker_url), node_id, block_size, token=token)
    stream = CacheEventStream(target, buffer)
    collector = StreamCollector(model_name, stream, buffer)
    registry.register(collector)
    try:
        await stream.run()
    finally:
        registry.unregister(collector)
