"""Admission control: which requests the node takes, and how many it holds now.

The waiting queue is measured as the larger of the engine's own waiting count (refreshed after
each engine step) and the requests this agent has handed to the engine that have no token yet
(exact at once, so a burst that arrives between two steps is seen in full). A request is
refused with 429 when that depth has reached `max_num_waiting_requests`, and deflected (429 with
`x-meridian-deflected`, for the region's Envoy to try another node) when it is an early Envoy
attempt and the depth has reached `deflect_at_waiting` (wire/deflection.py).
"""

from __future__ import annotations

import asyncio
import math

from node_agent.errors import DeflectedError, OverloadedError
from wire.deflection import DEFAULT_DEFLECT_AT_WAITING, should_deflect


class Ticket:
    """One admitted request's place; release it exactly once (later calls do nothing)."""

    __slots__ = ("_admission", "_is_released", "_is_started")

    def __init__(self, admission: Admission):
        self._admission = admission
        self._is_started = False
        self._is_released = False

    def mark_started(self) -> None:
        """The request produced its first token: it no longer counts as waiting."""
        if not self._is_started and not self._is_released:
            self._is_started = True
            self._admission.num_not_started -= 1

    def release(self) -> None:
        if self._is_released:
            return
        self.mark_started()
        self._is_released = True
        self._admission._on_release()


class Admission:
    def __init__(
        self,
        max_num_waiting_requests: int,
        retry_after_s: int,
        deflect_at_waiting: int = DEFAULT_DEFLECT_AT_WAITING,
    ):
        self.max_num_waiting_requests = max_num_waiting_requests
        self.retry_after_s = retry_after_s
        self.deflect_at_waiting = deflect_at_waiting
        self.num_deflected = 0
        self.num_in_flight = 0
        self.num_not_started = 0
        self.num_rejected = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def queue_depth(self, engine_num_waiting: int) -> int:
        return max(engine_num_waiting, self.num_not_started)

    def admit(self, engine_num_waiting: int, attempt: int | None = None) -> Ticket:
        """A ticket for a new request; OverloadedError (429) if the queue is full, DeflectedError
        (429) if Envoy's `attempt` (None: not through Envoy) should try another node."""
        depth = self.queue_depth(engine_num_waiting)
        if should_deflect(depth, attempt, self.deflect_at_waiting):
            self.num_deflected += 1
            raise DeflectedError(
                f"{depth} requests here are still waiting for their first token; try another node"
            )
        if depth >= self.max_num_waiting_requests:
            self.num_rejected += 1
            raise OverloadedError(
                f"the node is overloaded ({depth} requests waiting); retry after "
                f"{self.retry_after_s} s or try another node",
                retry_after_s=self.retry_after_s,
            )
        self.num_in_flight += 1
        self.num_not_started += 1
        self._idle.clear()
        return Ticket(self)

    async def wait_idle(self, timeout_s: float = math.inf) -> bool:
        """Wait until no request is in flight; False if `timeout_s` passed first."""
        try:
            async with asyncio.timeout(None if math.isinf(timeout_s) else timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    def _on_release(self) -> None:
        self.num_in_flight -= 1
        if self.num_in_flight == 0:
            self._idle.set()
