"""The discrete-event core: a virtual clock and a heap of timed callbacks.

Events at the same time run in the order they were scheduled (a sequence number breaks ties), so
a run depends only on its seed. Callbacks take one argument, so that hot paths schedule bound
methods instead of allocating closures.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class EventLoop:
    def __init__(self) -> None:
        self.now_s = 0.0
        self.num_events = 0
        self._heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._sequence = itertools.count()

    def at(self, time_s: float, callback: Callable[[Any], None], argument: Any = None) -> None:
        """Run `callback(argument)` at `time_s` (never in the past)."""
        when = time_s if time_s > self.now_s else self.now_s
        heapq.heappush(self._heap, (when, next(self._sequence), callback, argument))

    def after(self, delay_s: float, callback: Callable[[Any], None], argument: Any = None) -> None:
        self.at(self.now_s + delay_s, callback, argument)

    def run(self, until_s: float = float("inf")) -> None:
        """Run events in time order until none is left or the next is later than `until_s`."""
        heap, pop = self._heap, heapq.heappop
        while heap and heap[0][0] <= until_s:
            self.now_s, _, callback, argument = pop(heap)
            self.num_events += 1
            callback(argument)

    @property
    def num_pending(self) -> int:
        return len(self._heap)
