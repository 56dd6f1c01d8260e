"""The control plane's side: heartbeats in, region summaries out, and each PoP's watch on them.

The fleet state and the summaries are the control plane's own code: `control_plane.fleet.Fleet`
records beats and judges health by time (`sweep(now)`), `SummaryPublisher.follow_beat` publishes
what a beat changed (a node back to health refreshes its region at once; anything else waits for
the next tick), `SummaryPublisher.tick(now)` recomputes and versions the document. Only the glue
around them is here: the beat and sweep timers, and the network delays.

Each beat is a real `wire.heartbeat.Heartbeat`, made from the node's load at send time (with its
model's name and identity), sent every `heartbeat_interval_s` (the control plane's default) and
received one way later (plus the scenario's extra delay). A gateway watches the document with
blocking queries: a poll reaches the control plane one way after it was sent, is answered at once
if the index moved, else when it next moves, and the answer takes one way back; the gateway polls
again as soon as it has one. `PopWatch` plays that chain lazily, when the gateway next needs the
document.
"""

from __future__ import annotations

import bisect
import random
from collections import deque
from dataclasses import dataclass, field

from control_plane.changes import ChangeFeed
from control_plane.model import Fleet, NodeIdentity, Region
from control_plane.model import Node as FleetNode
from control_plane.settings import Settings as ControlPlaneSettings
from control_plane.summaries import SummaryPublisher, route_view
from simulator.events import EventLoop
from simulator.models import identity_of
from simulator.node import Node
from wire.capacity import DECODE_RATE_WINDOW_S
from wire.heartbeat import Heartbeat
from wire.model_catalog import ModelCatalog
from wire.region_summary import RegionSummary, RegionSummaryIndex
from wire.routing_policy import RoutingPolicy

# Simulated Unix time at simulated 0 (only heartbeats' informational timestamps carry it).
UNIX_AT_ZERO_S = 1_800_000_000.0


def _default(name: str) -> float:
    value = ControlPlaneSettings.model_fields[name].default
    assert isinstance(value, int | float)
    return float(value)


@dataclass(frozen=True, slots=True)
class ControlTiming:
    heartbeat_interval_s: float = _default("heartbeat_interval_s")
    unhealthy_after_s: float = _default("heartbeat_interval_s") * _default("missed_beats")
    sweep_interval_s: float = _default("sweep_interval_s")
    extra_beat_delay_s: float = 0.0  # the `stale` scenario's late capacity reports


@dataclass(slots=True)
class Beating:
    """A node's heartbeat loop: its recent decode rate comes from the last window's beats."""

    node: Node
    url: str
    delay_s: float  # node → control plane, one way
    samples: deque[tuple[float, float]] = field(default_factory=deque)


class SimControlPlane:
    def __init__(
        self,
        loop: EventLoop,
        timing: ControlTiming,
        regions: dict[str, Region],
        policy: RoutingPolicy,
        seed: int,
        catalog: ModelCatalog,
    ) -> None:
        self.loop = loop
        self.timing = timing
        self.fleet = Fleet(unhealthy_after_s=timing.unhealthy_after_s, regions=dict(regions))
        self.policy = policy
        self.catalog = catalog
        self.publisher = SummaryPublisher(
            self.fleet, self.read_policy, self.read_catalog, ChangeFeed(1)
        )
        self.published_s: list[float] = [0.0]
        self.documents: list[RegionSummaryIndex] = [self.publisher.current]
        self._rng = random.Random(f"heartbeats/{seed}")
        self.is_stopped = False
        self._beatings: list[Beating] = []

    def read_policy(self) -> RoutingPolicy:
        return self.policy

    def read_catalog(self) -> ModelCatalog:
        return self.catalog

    @property
    def current(self) -> RegionSummaryIndex:
        return self.publisher.current

    def add_node(self, node: Node, url: str, delay_s: float) -> None:
        identity = NodeIdentity(region=node.region, url=url, model=node.model, tp_size=1)
        self.fleet.nodes[node.name] = FleetNode(node.name, identity, False, UNIX_AT_ZERO_S)
        self._beatings.append(Beating(node, url, delay_s))

    def start(self) -> None:
        """Start every node's heartbeats (each at a seeded phase) and the sweep."""
        for beating in self._beatings:
            first_s = self._rng.uniform(0.0, self.timing.heartbeat_interval_s)
            self.loop.at(first_s, self._send_beat, beating)
        self.loop.at(self.timing.sweep_interval_s, self._tick)

    def _send_beat(self, beating: Beating) -> None:
        now_s = self.loop.now_s
        node = beating.node
        if self.is_stopped:
            return
        self.loop.at(now_s + self.timing.heartbeat_interval_s, self._send_beat, beating)
        if not node.is_up:
            beating.samples.clear()  # a restarted engine counts from zero
            return
        load = node.load(now_s)
        samples = beating.samples
        samples.append((now_s, load.generated_tokens))
        while samples[0][0] < now_s - DECODE_RATE_WINDOW_S:
            samples.popleft()
        calibration = node.calibration
        beat = Heartbeat(
            node_id=node.name,
            region=node.region,
            url=beating.url,
            model=node.model,
            model_identity=identity_of(node.model),
            kv_blocks_total=calibration.kv_blocks,
            kv_blocks_free=load.kv_blocks_free,
            block_size=calibration.block_size,
            num_running=load.num_running,
            num_waiting=load.num_waiting,
            num_waiting_prefill_tokens=load.num_waiting_prefill_tokens,
            num_running_prefill_tokens=load.num_running_prefill_tokens,
            decode_tokens_per_s=(load.generated_tokens - samples[0][1]) / DECODE_RATE_WINDOW_S,
            prefill_tokens_per_s=calibration.prefill_tokens_per_s,  # its node type's
            num_in_flight=load.num_in_flight,
            hot_prefixes=node.hot_prefixes.hot(),
            timestamp=UNIX_AT_ZERO_S + now_s,
        )
        arrive_s = now_s + beating.delay_s + self.timing.extra_beat_delay_s
        self.loop.at(arrive_s, self._receive_beat, beat)

    def _receive_beat(self, beat: Heartbeat) -> None:
        now_s = self.loop.now_s
        node = self.fleet.nodes[beat.node_id]
        was = route_view(node)
        self.fleet.record_beat(node, beat, now_s, UNIX_AT_ZERO_S + now_s)
        self._published_if(self.publisher.follow_beat(beat.region, was, node))

    def _tick(self, _: None) -> None:
        index = self.publisher.current.index
        self.publisher.tick(self.loop.now_s)
        self._published_if(self.publisher.current.index != index)
        if not self.is_stopped:
            self.loop.at(self.loop.now_s + self.timing.sweep_interval_s, self._tick)

    def _published_if(self, is_changed: bool) -> None:
        if is_changed:
            self.published_s.append(self.loop.now_s)
            self.documents.append(self.publisher.current)

    def stop(self) -> None:
        """Stop the timers, so that the event loop runs dry once the requests are done."""
        self.is_stopped = True


@dataclass(slots=True)
class PopWatch:
    """One gateway's blocking-query watch on the summaries, played out when it is read."""

    control: SimControlPlane
    delay_s: float  # PoP ↔ control plane, one way
    document: RegionSummaryIndex | None = None
    poll_at_cp_s: float = 0.0  # when the outstanding poll reaches the control plane

    def read(self, now_s: float) -> RegionSummaryIndex | None:
        """The latest document this gateway has received by `now_s`."""
        published_s, documents = self.control.published_s, self.control.documents
        held = -1 if self.document is None else self.document.index
        while True:
            position = bisect.bisect_right(published_s, self.poll_at_cp_s) - 1
            if position >= 0 and documents[position].index != held:
                answer_s = self.poll_at_cp_s  # the index moved while the poll was away
            elif position + 1 < len(documents):
                position += 1
                answer_s = published_s[position]  # the poll waits for the next change
            else:
                return self.document
            received_s = answer_s + self.delay_s
            if received_s > now_s:
                return self.document
            self.document = documents[position]
            held = self.document.index
            self.poll_at_cp_s = received_s + self.delay_s

    def summary_of(self, region: str, now_s: float) -> RegionSummary | None:
        """`region`'s summary in the latest document by `now_s` (None: none yet, or not in it)."""
        document = self.read(now_s)
        if document is None:
            return None
        return next((r for r in document.regions if r.name == region), None)
