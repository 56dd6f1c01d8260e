"""A circuit breaker: stop sending work to a backend that keeps failing (each region; Redis).

Closed: requests flow; `max_failures` failures in a row open it. Open: the region gets no new
work for `open_s` (its requests fail over to the next region at once instead of timing out
there). Then half-open: one probe request goes through; its success closes the breaker, its
failure opens it again for another `open_s`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum

logger = logging.getLogger(__name__)


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(slots=True)
class CircuitBreaker:
    name: str  # for the log: "region us-east", "redis"
    max_failures: int
    open_s: float
    state: BreakerState = BreakerState.CLOSED
    num_failures: int = 0  # consecutive
    opened_at_s: float = 0.0
    is_probing: bool = False

    def is_available(self, now_s: float) -> bool:
        """May a new request be sent here now? (Does not take the half-open probe slot.)"""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            return now_s - self.opened_at_s >= self.open_s
        return not self.is_probing

    def on_attempt(self, now_s: float) -> None:
        if self.state is BreakerState.OPEN and now_s - self.opened_at_s >= self.open_s:
            self.state = BreakerState.HALF_OPEN
        if self.state is BreakerState.HALF_OPEN:
            self.is_probing = True

    def on_success(self) -> None:
        if self.state is not BreakerState.CLOSED:
            logger.info("%s: circuit closed", self.name)
        self.state = BreakerState.CLOSED
        self.num_failures = 0
        self.is_probing = False

    def on_abandon(self) -> None:
        """An attempt ended with no verdict (the client left): free the probe slot."""
        self.is_probing = False

    def on_failure(self, now_s: float) -> None:
        self.num_failures += 1
        self.is_probing = False
        if self.state is BreakerState.HALF_OPEN or self.num_failures >= self.max_failures:
            if self.state is not BreakerState.OPEN:
                logger.warning(
                    "%s: circuit open for %.1f s after %d failures",
                    self.name,
                    self.open_s,
                    self.num_failures,
                )
            self.state = BreakerState.OPEN
            self.opened_at_s = now_s
