"""Draining: stop admitting, let in-flight requests finish, then (when allowed) stop the server.

The control plane runs one drain sequence per node (control_plane/drain.py) and steers it through
the heartbeat reply: `drain: true` starts a drain here (stop admitting, keep beating, report
`draining`), `may_exit: true` ends it (exit 0 once nothing is in flight), and `drain: false`
before that resumes admission. SIGTERM also starts a drain that ends in an exit: while the control
plane is reachable the node waits for its `may_exit` (so it is out of every route first), for at
most the drain timeout; with no control plane, or none reachable, it exits once in-flight
requests finish, as it always did. A drain that times out exits anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from node_agent.admission import Admission

logger = logging.getLogger(__name__)

POLL_S = 0.05


class Drain:
    def __init__(self, admission: Admission, timeout_s: float):
        self._admission = admission
        self._timeout_s = timeout_s
        self.is_draining = False
        # An exit is under way (SIGTERM, or the control plane's `may_exit`): no undrain any more.
        self.will_exit = False
        # The control plane said `may_exit`: it routes nothing here any more.
        self.may_exit = False
        self.reason: str | None = None
        # Called once drained when the drain should end the process (the server sets it).
        self.on_drained: Callable[[], None] | None = None
        # True while a control plane is there to wait for (the runtime sets it): an exit then
        # waits for `may_exit`; otherwise it goes ahead once nothing is in flight.
        self.control_plane_reachable: Callable[[], bool] = lambda: False
        self._exit_deadline = 0.0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def begin(self, reason: str, exit_when_drained: bool) -> None:
        """Stop admitting now; finish in flight; then exit if asked. Safe to call repeatedly."""
        if exit_when_drained:
            self._want_exit()
        if self.is_draining:
            self._exit_now_if_drained()
            return
        self.is_draining = True
        self.reason = reason
        logger.info(
            "draining (%s): refusing new requests, %d in flight",
            reason,
            self._admission.num_in_flight,
        )
        self._task = asyncio.create_task(self._run(), name="drain")

    def allow_exit(self) -> None:
        """The control plane said `may_exit`: exit once nothing is in flight."""
        if not self.may_exit:
            logger.info(
                "the control plane allows this node to exit (%d in flight)",
                self._admission.num_in_flight,
            )
        self.may_exit = True
        self._want_exit()
        self._exit_now_if_drained()

    def cancel(self) -> bool:
        """Resume admitting (the control plane undrained us); not once an exit is under way."""
        if not self.is_draining or self.will_exit:
            return False
        if self._task is not None:
            self._task.cancel()
        self.is_draining = False
        self.reason = None
        logger.info("drain cancelled: admitting requests again")
        return True

    async def close(self) -> None:
        """Stop the drain's task (the app is shutting down)."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _exit_now_if_drained(self) -> None:
        """Exit at once (not a poll later) when an exit is allowed and nothing is in flight."""
        if not self.is_draining or self._task is None or self._task.done():
            return
        loop_time = asyncio.get_running_loop().time()
        if self.will_exit and self._can_exit(self._admission.num_in_flight == 0, loop_time):
            self._task.cancel()
            self._finish()

    def _want_exit(self) -> None:
        if not self.will_exit:
            self.will_exit = True
            self._exit_deadline = asyncio.get_running_loop().time() + self._timeout_s
        self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        idle_by = loop.time() + self._timeout_s
        idle_logged = False
        while True:
            now = loop.time()
            idle = self._admission.num_in_flight == 0
            if idle and not idle_logged:
                logger.info("drained: no requests in flight")
                idle_logged = True
            elif not idle and not idle_logged and now >= idle_by:
                logger.warning(
                    "drain timed out after %.0f s with %d requests in flight",
                    self._timeout_s,
                    self._admission.num_in_flight,
                )
                idle_logged = True
            if self.will_exit and self._can_exit(idle, now):
                self._finish()
                return
            self._wake.clear()
            await self._wait(idle)

    async def _wait(self, idle: bool) -> None:
        """Until woken (exit asked), nothing is in flight any more, or the next poll."""
        waits: list[asyncio.Future[bool]] = [asyncio.ensure_future(self._wake.wait())]
        if not idle:
            waits.append(asyncio.ensure_future(self._admission.wait_idle()))
        try:
            await asyncio.wait(waits, timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()

    def _can_exit(self, idle: bool, now: float) -> bool:
        if now >= self._exit_deadline:
            logger.warning(
                "exiting: drain timeout of %.0f s reached (%d in flight, may_exit %s)",
                self._timeout_s,
                self._admission.num_in_flight,
                self.may_exit,
            )
            return True
        if not idle:
            return False
        return self.may_exit or not self.control_plane_reachable()

    def _finish(self) -> None:
        if self.on_drained is not None:
            self.on_drained()
