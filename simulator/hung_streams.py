"""Streams from hung nodes: a hung node keeps its connections open and sends nothing more, so a
stream breaks when the gateway's relay gives up on its silence (`gateway.relay.SilenceLimits`,
read against the summaries its PoP holds: soon once they show the node unhealthy, or its region
with no healthy node), or when the node's restart resets its connections, one way later."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from functools import partial

from gateway.relay import SilenceLimits
from simulator.control import PopWatch
from simulator.delays import OneWayDelays
from simulator.events import EventLoop
from simulator.first_byte import pop_views
from simulator.flight import AttemptEvent, Flight
from simulator.gateway_timing import GatewayTiming
from simulator.site import Site

# (flight, attempt, the silence's start at the origin, node)
Silence = tuple[Flight, int, float, str]
# The stream of an attempt broke, its silence begun at the origin at the time given.
OnBroken = Callable[[AttemptEvent, float], None]


class HungStreams:
    def __init__(
        self,
        loop: EventLoop,
        sites: Mapping[str, Site],
        delays: OneWayDelays,
        timing: GatewayTiming,
        watches: Mapping[str, PopWatch],
        on_broken: OnBroken,
    ) -> None:
        self.loop = loop
        self.sites = sites
        self.delays = delays
        self.timing = timing
        self.on_broken = on_broken
        summary_of = pop_views(watches, loop)
        self.silences = {
            pop: SilenceLimits(
                timing.stream_idle_timeout_s,
                timing.unhealthy_node_silence_s,
                partial(summary_of, pop),
            )
            for pop in watches
        }
        # Clients that go to a region directly: only their own patience, the same idle limit.
        self.silences[""] = SilenceLimits(
            timing.stream_idle_timeout_s, timing.unhealthy_node_silence_s, lambda _: None
        )
        self._hung: dict[str, list[Silence]] = {}  # by region

    def hold(self, flight: Flight) -> None:
        """The node of `flight`'s attempt under way hung: nothing more comes once the bytes on
        their way have arrived."""
        assert flight.site is not None and flight.node is not None
        silent_from_s = self.loop.now_s + self.delays.between(flight.site.location, flight.origin)
        event = (flight, flight.attempt, silent_from_s, flight.node.name)
        self._hung.setdefault(flight.site.name, []).append(event)
        self.loop.at(silent_from_s + self.timing.unhealthy_node_silence_s, self._silent, event)

    def restarted(self, region: str, nodes: Collection[str]) -> None:
        """These hung nodes of `region` were restarted: the old processes' connections reset,
        which ends the silences they still held one way later."""
        site = self.sites[region]
        held = self._hung.pop(region, [])
        self._hung[region] = [event for event in held if event[3] not in nodes]
        for event in held:
            flight = event[0]
            if event[3] in nodes and event[1] == flight.attempt and not flight.is_ended:
                back_s = self.loop.now_s + self.delays.between(site.location, flight.origin)
                self.loop.at(back_s, self._reset, event)

    def _reset(self, event: Silence) -> None:
        self.on_broken(event[:2], event[2])

    def _silent(self, event: Silence) -> None:
        """The relay's look at a silent stream, every `unhealthy_s` of its silence."""
        flight, attempt, silent_from_s, node = event
        if attempt != flight.attempt or flight.is_ended or not flight.is_streaming:
            return  # resumed or ended, or no first byte (its timeout is armed)
        assert flight.pick is not None
        silence = self.silences[flight.pop]
        now_s = self.loop.now_s
        give_up_s = silent_from_s + silence.of(flight.pick.region, node)  # absolute: no creep
        if now_s >= give_up_s:
            self.on_broken((flight, attempt), silent_from_s)
        else:
            self.loop.at(min(give_up_s, now_s + silence.unhealthy_s), self._silent, event)
