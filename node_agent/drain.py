"""Draining: stop admitting, let in-flight requests finish, then (if asked) stop the server.

Two things start a drain: SIGTERM (always exits once drained) and the control plane's `drain:
true` (exits only with `exit_on_control_plane_drain`; otherwise the node stays up reporting
itself draining, and `drain: false` resumes admission).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from node_agent.admission import Admission

logger = logging.getLogger(__name__)


class Drain:
    def __init__(self, admission: Admission, timeout_s: float):
        self._admission = admission
        self._timeout_s = timeout_s
        self.is_draining = False
        self.will_exit = False
        self.reason: str | None = None
        # Called once drained when the drain should end the process (the server sets it).
        self.on_drained: Callable[[], None] | None = None
        self._task: asyncio.Task[None] | None = None

    def begin(self, reason: str, exit_when_drained: bool) -> None:
        """Stop admitting now; finish in flight; then exit if asked. Safe to call repeatedly."""
        self.will_exit = self.will_exit or exit_when_drained
        if self.is_draining:
            if self.will_exit and self._task is not None and self._task.done():
                self._finish()
            return
        self.is_draining = True
        self.reason = reason
        logger.info(
            "draining (%s): refusing new requests, %d in flight",
            reason,
            self._admission.num_in_flight,
        )
        self._task = asyncio.create_task(self._wait_then_finish(), name="drain")

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

    async def _wait_then_finish(self) -> None:
        if not await self._admission.wait_idle(self._timeout_s):
            logger.warning(
                "drain timed out after %.0f s with %d requests in flight",
                self._timeout_s,
                self._admission.num_in_flight,
            )
        else:
            logger.info("drained: no requests in flight")
        if self.will_exit:
            self._finish()

    def _finish(self) -> None:
        if self.on_drained is not None:
            self.on_drained()
