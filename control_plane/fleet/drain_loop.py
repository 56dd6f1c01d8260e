"""The drain loop: on the leader, moves every drain sequence and writes what moved.

Each step ticks the `DrainBook` (`control_plane.drain.book`), writes the sequences that moved with
their audit entries in one transaction (carrying the lease's epoch between replicas), makes the
Consul calls the steps asked for, and ends the deletes of regions whose nodes have all been told
to exit. A step runs every interval, or as soon as the registry notes a change that may start or
end a drain (`drains_noted`). A replica that is not leading steps nothing: it follows the
leader's writes (`Registry.follow`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Final

from control_plane.consul_sync import ConsulSync
from control_plane.drain.book import DrainBook
from control_plane.drain.sequence import ACTOR as DRAIN_ACTOR
from control_plane.fleet.registry import Registry
from control_plane.fleet.sql import FleetStore
from control_plane.leadership import Leadership

logger = logging.getLogger(__name__)

CONSUL_CALL_TIMEOUT_S: Final = 5.0


@dataclass(eq=False, slots=True)
class DrainLoop:
    registry: Registry
    book: DrainBook
    store: FleetStore
    leadership: Leadership
    drains_noted: asyncio.Event
    consul: ConsulSync | None
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set, init=False)

    async def step(self) -> None:
        """On the leader: move every drain sequence, write what moved, make the Consul calls the
        steps asked for, and end the deletes of regions whose nodes have all been told to exit."""
        epoch = self.leadership.epoch
        if not self.leadership.is_leader:
            return
        self.book.tick()
        writes = self.book.take_writes()
        if writes:
            try:
                await self.store.write_drains(writes.rows, writes.entries, time.time(), epoch)
            except BaseException:
                self.book.put_back(writes)  # written again with the next step
                raise
        for node_id in self.book.take_consul_calls():
            if self.consul is not None:
                self._spawn(_deregister_from_consul(self.consul, node_id))
        for name in self.book.drained_regions():
            await self.registry.finish_region_delete(DRAIN_ACTOR, name)

    def _spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def run(self, interval_s: float) -> None:
        """Until cancelled: a step every `interval_s`, or as soon as a drain is noted."""
        try:
            while True:
                # asyncio.timeout, not wait_for: in 3.11 wait_for can swallow a cancellation
                # that races with the event, and the lifespan would wait for this loop forever.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(interval_s):
                        await self.drains_noted.wait()
                self.drains_noted.clear()
                try:
                    await self.step()
                except Exception:
                    logger.exception("drain step failed")  # the next step tries again
        finally:
            for task in list(self._tasks):
                task.cancel()

    async def take_lead(self) -> None:
        """Just elected: resume every drain where the store says it stood, then lead."""
        await self.registry.adopt_drains(await self.store.read_drains())
        self.drains_noted.set()


async def _deregister_from_consul(consul: ConsulSync, node_id: str) -> None:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(CONSUL_CALL_TIMEOUT_S):
            await consul.deregister(node_id)
