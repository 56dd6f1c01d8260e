"""The node's copy of its engine's prefix cache, and the batches waiting to go to the picker.

The engine hands its cache events to `apply` on the event loop (engine/async_engine.py
`watch_cache`): the copy follows them exactly, and each batch queues for the stream under the
next sequence number. The queue is bounded, so a picker that reads slowly (or not at all) never
holds the node's memory or its event loop: on overflow the queued batches are dropped and the
next message is a snapshot of the copy instead, which includes them.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from engine.cache_events import CacheEvents


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every hash held after batch `seq`."""

    seq: int
    hashes: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class Delta:
    """Batch `seq`."""

    seq: int
    events: CacheEvents


@dataclass(slots=True)
class BufferStats:
    num_batches: int = 0
    num_overflows: int = 0  # times the queue was dropped for a snapshot
    num_snapshots: int = 0


class CacheEventBuffer:
    def __init__(self, max_pending_batches: int) -> None:
        if max_pending_batches < 1:
            raise ValueError("max_pending_batches must be >= 1")
        self._max_pending = max_pending_batches
        self._held: set[bytes] = set()
        self._seq = 0
        self._pending: deque[Delta] = deque()
        self._needs_snapshot = True
        self._ready = asyncio.Event()
        self.stats = BufferStats()

    def apply(self, events: CacheEvents) -> None:
        """The engine's listener: follow its cache, queue the batch (never blocks)."""
        if events.is_snapshot:
            held = set(events.stored)
            if held != self._held:  # the picker needs to hear of it (else: nothing new)
                self._held = held
                self.request_snapshot()
            return
        self._held.difference_update(events.removed)
        self._held.update(events.stored)
        self._seq += 1
        self.stats.num_batches += 1
        if self._needs_snapshot:
            return  # the snapshot to come includes this batch
        if len(self._pending) >= self._max_pending:
            self.stats.num_overflows += 1
            self.request_snapshot()
            return
        self._pending.append(Delta(self._seq, events))
        self._ready.set()

    def request_snapshot(self) -> None:
        """Send the whole copy next (a new connection, the picker missed a batch)."""
        self._needs_snapshot = True
        self._pending.clear()
        self._ready.set()

    def next_message(self) -> Snapshot | Delta | None:
        """What to send next (None: nothing yet; `wait` for it)."""
        if self._needs_snapshot:
            self._needs_snapshot = False
            self.stats.num_snapshots += 1
            return Snapshot(self._seq, tuple(self._held))
        if self._pending:
            return self._pending.popleft()
        self._ready.clear()
        return None

    async def wait(self) -> None:
        await self._ready.wait()
