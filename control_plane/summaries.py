"""Region summaries for gateways, and the versioned index they are watched by.

Summaries are recomputed from the in-memory fleet right after every routing-relevant change (a
region edited, a node registered, drained or back to health) and on every sweep tick (default
0.25 s), which also judges node health by time. The index moves only when the document actually
differs, so a waiting gateway wakes at most once per tick and hears of any change within about
`sweep_interval_s`. A change to one node (registered, back to health) recomputes only its region
(`refresh_region`), so that a thousand nodes registering in a second do not cost a thousand
recomputations of the whole fleet; a tick likewise recomputes only the regions whose nodes beat
or fell silent since the last one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from control_plane.changes import ChangeFeed
from control_plane.model import Fleet, Node, Region
from wire.model_catalog import ModelCatalog
from wire.region_summary import QueueEstimate, RegionSummary, RegionSummaryIndex
from wire.routing_policy import RoutingPolicy

logger = logging.getLogger(__name__)

MAX_QUEUE_DELAY_S = 600.0
MIN_TOKENS_PER_S = 1.0


def expected_queue_delay_s(num_waiting_prefill_tokens: int, decode_tokens_per_s: float) -> float:
    """Seconds to work off the waiting prompt tokens at the region's recent token throughput.

    A deliberately simple, pessimistic proxy (prefill runs faster than decode): gateways weigh it
    against RTT with `queue_weight`, which absorbs the constant factor. Capped at 10 minutes.
    """
    if num_waiting_prefill_tokens == 0:
        return 0.0
    delay_s = num_waiting_prefill_tokens / max(decode_tokens_per_s, MIN_TOKENS_PER_S)
    return round(min(delay_s, MAX_QUEUE_DELAY_S), 3)


def summarize_region(region: Region, nodes: list[Node]) -> RegionSummary:
    """One region's summary from its nodes' latest beats (one pass: it runs for every region on
    every tick)."""
    num_routable = num_waiting = num_waiting_prefill_tokens = num_running_prefill_tokens = 0
    kv_blocks_free = kv_blocks_total = 0
    decode_tokens_per_s = 0.0
    unhealthy: list[str] = []
    for node in nodes:
        if not node.is_in_summaries:
            if not node.is_healthy:
                unhealthy.append(node.node_id)
            continue
        num_routable += 1
        beat = node.last_beat
        if beat is None:  # known only from Consul: healthy, but no capacity reported
            continue
        num_waiting += beat.num_waiting
        num_waiting_prefill_tokens += beat.num_waiting_prefill_tokens
        num_running_prefill_tokens += beat.num_running_prefill_tokens
        decode_tokens_per_s += beat.decode_tokens_per_s
        kv_blocks_free += beat.kv_blocks_free
        kv_blocks_total += beat.kv_blocks_total
    decode_tokens_per_s = round(decode_tokens_per_s, 3)
    queue = QueueEstimate(
        num_waiting=num_waiting,
        num_waiting_prefill_tokens=num_waiting_prefill_tokens,
        num_running_prefill_tokens=num_running_prefill_tokens,
        decode_tokens_per_s=decode_tokens_per_s,
        expected_queue_delay_s=expected_queue_delay_s(
            num_waiting_prefill_tokens, decode_tokens_per_s
        ),
    )
    return RegionSummary(
        name=region.name,
        lat=region.lat,
        lon=region.lon,
        state=region.state,
        ingress_url=region.ingress_url,
        healthy_nodes=num_routable,
        unhealthy_nodes=tuple(sorted(unhealthy)),
        kv_blocks_free=kv_blocks_free,
        kv_blocks_total=kv_blocks_total,
        queue=queue,
        weight=region.weight,
    )


# What of a node routes follow at once rather than at the next tick: (routable, in summaries).
RouteView = tuple[bool, bool]


def route_view(node: Node) -> RouteView:
    return node.is_routable, node.is_in_summaries


def summarize(fleet: Fleet) -> list[RegionSummary]:
    """One summary per registered region, sorted by name; nodes of unknown regions are left out."""
    by_region: dict[str, list[Node]] = {name: [] for name in fleet.regions}
    for node in fleet.nodes.values():
        members = by_region.get(node.identity.region)
        if members is not None:
            members.append(node)
    return [summarize_region(fleet.regions[name], by_region[name]) for name in sorted(by_region)]


class SummaryPublisher:
    """Holds the current `RegionSummaryIndex` (and its JSON), moving the feed when it changes.
    The document carries the operator's routing policy and model catalog as `read_policy` and
    `read_catalog` give them now (their registries call `refresh` after every change)."""

    def __init__(
        self,
        fleet: Fleet,
        read_policy: Callable[[], RoutingPolicy],
        read_catalog: Callable[[], ModelCatalog],
        feed: ChangeFeed,
    ) -> None:
        self.feed = feed
        self._fleet = fleet
        self._read_policy = read_policy
        self._read_catalog = read_catalog
        self._dirty_regions: set[str] = set()  # live capacity changed since the last publish
        self._is_health_held = False
        self._current = RegionSummaryIndex(
            index=feed.index,
            regions=summarize(fleet),
            routing=read_policy(),
            catalog=read_catalog(),
        )
        self._body: bytes | None = None  # encoded when first asked for

    @property
    def current(self) -> RegionSummaryIndex:
        return self._current

    @property
    def body(self) -> bytes:
        """The current document as JSON, encoded once per index for every waiting gateway (and
        only when one asks: an index that moves again before any gateway reads it costs none)."""
        if self._body is None:
            self._body = self._current.model_dump_json().encode()
        return self._body

    def mark_dirty(self, region: str) -> None:
        """Live capacity in `region` changed: publish it at the next tick (coalesces many
        heartbeats)."""
        self._dirty_regions.add(region)

    def refresh(self) -> bool:
        """Recompute now; returns True (and moves the index) if the document changed."""
        self._dirty_regions.clear()
        regions = summarize(self._fleet)
        routing, catalog = self._read_policy(), self._read_catalog()
        current = self._current
        if (regions, routing, catalog) == (current.regions, current.routing, current.catalog):
            return False
        self._publish(regions, routing, catalog)
        return True

    def follow_beat(self, region: str, was: RouteView, node: Node) -> bool:
        """After a node's beat has been recorded (`was`: its route view before): publish its
        region now if the node came into or left the routes (back to health), else at the next
        tick (only live capacity changed; many beats coalesce). True if the document changed."""
        if route_view(node) != was:
            return self.refresh_region(region)
        self.mark_dirty(region)
        return False

    def refresh_region(self, name: str) -> bool:
        """Recompute one region's summary now (the others cannot have changed); returns True
        (and moves the index) if it changed. Live capacity elsewhere waits for the next tick."""
        return self._refresh_regions({name})

    def _refresh_regions(self, names: set[str]) -> bool:
        self._dirty_regions -= names
        regions = list(self._current.regions)
        positions = {summary.name: i for i, summary in enumerate(regions)}
        is_changed = False
        for name in names:
            region = self._fleet.regions.get(name)
            position = positions.get(name)
            if region is None and position is None:
                continue  # unregistered regions are not in the document
            if region is None or position is None:
                return self.refresh()  # a region the document has lost, or does not have yet
            summary = summarize_region(region, self._fleet.nodes_in(name))
            if regions[position] != summary:
                regions[position] = summary
                is_changed = True
        if is_changed:
            self._publish(regions, self._current.routing, self._current.catalog)
        return is_changed

    def _publish(
        self, regions: list[RegionSummary], routing: RoutingPolicy, catalog: ModelCatalog | None
    ) -> None:
        self._current = RegionSummaryIndex(
            index=self.feed.advance(), regions=regions, routing=routing, catalog=catalog
        )
        self._body = None

    def hold_health(self) -> None:
        """Stop judging health by silence (the control plane is stopping: new connections are
        refused, so silence says nothing about the nodes); live capacity is still published."""
        self._is_health_held = True

    def tick(self, now_mono: float) -> None:
        silent = [] if self._is_health_held else self._fleet.sweep(now_mono)
        dirty = self._dirty_regions | {node.identity.region for node in silent}
        if dirty:
            self._refresh_regions(dirty)

    async def run(self, interval_s: float) -> None:
        """Sweep health and publish changes every `interval_s`, until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                self.tick(time.monotonic())
            except Exception:
                # One bad tick must not stop health sweeps for good.
                logger.exception("summary sweep failed")
