"""The gateway's first-byte timeouts on the simulated clock, as gateway/proxy.py keeps them: an
attempt with no first byte `first_byte_timeout_s` after it was sent is given up on (then fails
over), unless the gateway waits on it past that (`gateway.attempts.waits_past_timeout`: the last
region an opening may try, while the summaries its PoP holds show the region a healthy node),
asking again every `unhealthy_node_silence_s` as the proxy does."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping

from gateway.attempts import waits_past_timeout
from simulator.control import PopWatch
from simulator.events import EventLoop
from simulator.flight import AttemptEvent
from simulator.gateway_timing import GatewayTiming
from wire.region_summary import RegionSummary

# A PoP's view of a region now: its summary in the latest document the PoP holds (None: none).
SummaryOf = Callable[[str, str], RegionSummary | None]


class FirstByteTimers:
    def __init__(
        self,
        loop: EventLoop,
        timing: GatewayTiming,
        summary_of: SummaryOf,
        on_timeout: Callable[[AttemptEvent], None],
    ) -> None:
        self.loop = loop
        self.timing = timing
        self.summary_of = summary_of
        self.on_timeout = on_timeout
        # All of one length, so they fall due in the order they were set: one timer for the
        # earliest replaces an event per attempt.
        self._deadlines: deque[tuple[float, AttemptEvent]] = deque()
        self._is_armed = False

    def arm(self, event: AttemptEvent, sent_s: float) -> None:
        self._deadlines.append((sent_s + self.timing.first_byte_timeout_s, event))
        if not self._is_armed:
            self._is_armed = True
            self.loop.at(self._deadlines[0][0], self._expire)

    def _expire(self, _: None) -> None:
        deadlines, now_s = self._deadlines, self.loop.now_s
        while deadlines and deadlines[0][0] <= now_s:
            self._due(deadlines.popleft()[1])
        if deadlines:
            self.loop.at(deadlines[0][0], self._expire)
        else:
            self._is_armed = False

    def _due(self, event: AttemptEvent) -> None:
        flight, attempt = event
        if attempt != flight.attempt or flight.is_ended or flight.is_streaming:
            return
        assert flight.pick is not None and flight.step is not None
        assert flight.attempts is not None
        now_s = self.loop.now_s
        summary = self.summary_of(flight.pop, flight.pick.region)
        if now_s < flight.attempts.deadline_s and waits_past_timeout(flight.step, summary):
            self.loop.at(now_s + self.timing.unhealthy_node_silence_s, self._due, event)
        else:
            self.on_timeout(event)


def pop_views(watches: Mapping[str, PopWatch], loop: EventLoop) -> SummaryOf:
    """The PoPs' views through their watches; a client that goes to a region directly (no PoP)
    has none."""

    def summary_of(pop: str, region: str) -> RegionSummary | None:
        watch = watches.get(pop)
        return None if watch is None else watch.summary_of(region, loop.now_s)

    return summary_of
