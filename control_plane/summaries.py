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
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from control_plane.changes import ChangeFeed
from control_plane.model import Fleet, Listed, Node, Region, listed_models
from wire.heartbeat import Heartbeat
from wire.model_catalog import ModelCatalog
from wire.prefix_key import MAX_HOT_PREFIXES
from wire.region_summary import (
    HotPrefix,
    ModelLoad,
    QueueEstimate,
    RegionSummary,
    RegionSummaryIndex,
)
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


@dataclass(slots=True)
class _Load:
    """Sums over some of a region's nodes in the summaries: one model's, or all of them."""

    num_nodes: int = 0
    num_waiting: int = 0
    num_waiting_prefill_tokens: int = 0
    num_running_prefill_tokens: int = 0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    decode_tokens_per_s: float = 0.0
    # The prefill rates the nodes reported: their sum, and how many reported one.
    prefill_tokens_per_s: float = 0.0
    num_rated_nodes: int = 0
    serving_keys: set[str] = field(default_factory=set)
    context_length: int | None = None  # the least reported
    hot_prefixes: tuple[HotPrefix, ...] = ()  # one model's digest (a total keeps none)

    @classmethod
    def of(cls, beats: list[Heartbeat | None]) -> _Load:
        """One model's nodes by their latest beats (None: known only from Consul, or restored:
        healthy, but no capacity reported)."""
        waiting = waiting_prefill = running_prefill = kv_free = kv_total = 0
        decode_tokens_per_s = prefill_tokens_per_s = 0.0
        num_rated = 0
        serving_keys: set[str] = set()
        contexts: list[int] = []
        hot: Counter[str] = Counter()
        for beat in beats:  # in locals: this loop is most of a tick's work
            if beat is None:
                continue
            waiting += beat.num_waiting
            waiting_prefill += beat.num_waiting_prefill_tokens
            running_prefill += beat.num_running_prefill_tokens
            decode_tokens_per_s += beat.decode_tokens_per_s
            kv_free += beat.kv_blocks_free
            kv_total += beat.kv_blocks_total
            if beat.prefill_tokens_per_s is not None:
                prefill_tokens_per_s += beat.prefill_tokens_per_s
                num_rated += 1
            identity = beat.model_identity
            if identity is not None:
                serving_keys.add(identity.serving_key)
                contexts.append(identity.context_length)
            hot.update(beat.hot_prefixes)
        return cls(
            len(beats),
            waiting,
            waiting_prefill,
            running_prefill,
            kv_free,
            kv_total,
            decode_tokens_per_s,
            prefill_tokens_per_s,
            num_rated,
            serving_keys,
            min(contexts, default=None),
            hot_digest(hot),
        )

    def add(self, other: _Load) -> None:
        """Count `other`'s nodes in this total (the identities stay theirs)."""
        self.num_nodes += other.num_nodes
        self.num_waiting += other.num_waiting
        self.num_waiting_prefill_tokens += other.num_waiting_prefill_tokens
        self.num_running_prefill_tokens += other.num_running_prefill_tokens
        self.decode_tokens_per_s += other.decode_tokens_per_s
        self.prefill_tokens_per_s += other.prefill_tokens_per_s
        self.num_rated_nodes += other.num_rated_nodes
        self.kv_blocks_free += other.kv_blocks_free
        self.kv_blocks_total += other.kv_blocks_total

    def queue(self) -> QueueEstimate:
        decode_tokens_per_s = round(self.decode_tokens_per_s, 3)
        return QueueEstimate(
            num_waiting=self.num_waiting,
            num_waiting_prefill_tokens=self.num_waiting_prefill_tokens,
            num_running_prefill_tokens=self.num_running_prefill_tokens,
            decode_tokens_per_s=decode_tokens_per_s,
            expected_queue_delay_s=expected_queue_delay_s(
                self.num_waiting_prefill_tokens, decode_tokens_per_s
            ),
            prefill_tokens_per_s=(
                round(self.prefill_tokens_per_s / self.num_rated_nodes, 1)
                if self.num_rated_nodes
                else None
            ),
        )

    def model(self, name: str) -> ModelLoad:
        return ModelLoad(
            name=name,
            serving_keys=tuple(sorted(self.serving_keys)),
            context_length=self.context_length,
            healthy_nodes=self.num_nodes,
            kv_blocks_free=self.kv_blocks_free,
            kv_blocks_total=self.kv_blocks_total,
            queue=self.queue(),
            hot_prefixes=self.hot_prefixes,
        )


def hot_digest(counts: Mapping[str, int]) -> tuple[HotPrefix, ...]:
    """The MAX_HOT_PREFIXES keys reported by the most nodes (then by key, so that the same
    counts give the same digest and leave the document's index where it is)."""
    if not counts:
        return ()
    top = sorted(counts.items(), key=_most_nodes_first)[:MAX_HOT_PREFIXES]
    return tuple(_hot_prefix(key, nodes) for key, nodes in top)


def _most_nodes_first(item: tuple[str, int]) -> tuple[int, str]:
    return -item[1], item[0]


@functools.lru_cache(maxsize=2**16)
def _hot_prefix(key: str, nodes: int) -> HotPrefix:
    """One entry of a digest: the same few (key, nodes) recur tick after tick, and validating
    each anew was most of a tick's digests (keys come from validated beats)."""
    return HotPrefix(key=key, nodes=nodes)


def summarize_region(region: Region, nodes: list[Node], listed: Listed = None) -> RegionSummary:
    """One region's summary from its nodes' latest beats, with a load per model (`listed`: the
    models to list, None for all: then also a model whose nodes are all unhealthy or draining,
    with 0 healthy nodes). It runs for every region on every tick: each beat is summed
    once, into its model's load, and the region's totals are the sum of those."""
    by_model: dict[str, list[Heartbeat | None]] = {}
    unhealthy: list[str] = []
    for node in nodes:
        if not node.is_in_summaries:
            if not node.is_healthy:
                unhealthy.append(node.node_id)
            if listed is None:
                # An empty catalog: the model stays known, with no capacity (a 503 and its
                # fallbacks, not a 404), while any registered node serves it.
                by_model.setdefault(node.identity.model, [])
            continue
        beats = by_model.get(node.identity.model)
        if beats is None:
            beats = by_model[node.identity.model] = []
        beats.append(node.last_beat)
    total = _Load()
    models: list[ModelLoad] = []
    for name in sorted(by_model):
        load = _Load.of(by_model[name])
        total.add(load)
        if listed is None or name in listed:  # unlisted: in the totals, routed to by no model
            models.append(load.model(name))
    return RegionSummary(
        name=region.name,
        lat=region.lat,
        lon=region.lon,
        state=region.state,
        ingress_url=region.ingress_url,
        healthy_nodes=total.num_nodes,
        unhealthy_nodes=tuple(sorted(unhealthy)),
        kv_blocks_free=total.kv_blocks_free,
        kv_blocks_total=total.kv_blocks_total,
        queue=total.queue(),
        weight=region.weight,
        models=tuple(models),
    )


# What of a node routes follow at once rather than at the next tick: (routable, in summaries).
RouteView = tuple[bool, bool]


def route_view(node: Node) -> RouteView:
    return node.is_routable, node.is_in_summaries


def summarize(fleet: Fleet, listed: Listed = None) -> list[RegionSummary]:
    """One summary per registered region, sorted by name; nodes of unknown regions are left out."""
    by_region: dict[str, list[Node]] = {name: [] for name in fleet.regions}
    for node in fleet.nodes.values():
        members = by_region.get(node.identity.region)
        if members is not None:
            members.append(node)
    return [
        summarize_region(fleet.regions[name], by_region[name], listed) for name in sorted(by_region)
    ]


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
        catalog = read_catalog()
        self._listed = listed_models(catalog)  # the current document's, for its catalog
        self._current = RegionSummaryIndex(
            index=feed.index,
            regions=summarize(fleet, self._listed),
            routing=read_policy(),
            catalog=catalog,
        )
        self._body: bytes | None = None  # encoded when first asked for

    @property
    def current(self) -> RegionSummaryIndex:
        return self._current

    @property
    def listed(self) -> Listed:
        """The models the current document's catalog lets be routed to (None: all)."""
        return self._listed

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
        routing, catalog = self._read_policy(), self._read_catalog()
        listed = listed_models(catalog)
        regions = summarize(self._fleet, listed)
        current = self._current
        if (regions, routing, catalog) == (current.regions, current.routing, current.catalog):
            return False
        self._listed = listed
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
            summary = summarize_region(region, self._fleet.nodes_in(name), self._listed)
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
