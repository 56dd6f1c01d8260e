"""The region-choice policies compared on identical traffic.

- `meridian`: the gateway's own `gateway.routing.Router` (one per PoP, default settings), its
  circuit breakers and its failover order, fed the summaries each PoP's watch has received.
- `round_robin`: each PoP cycles over the regions its summaries say are active and healthy.
- `nearest`: geo-DNS alone: the control plane's real DNS steering answers each client city (with
  resolver caches that keep an answer for its TTL); clients go straight to that region and do
  not retry elsewhere.
- `least_loaded`: each PoP picks the region with the least queue in its summaries (then KV use,
  then its own requests in flight there per node), ignoring distance.
- `oracle`: sees every node's true queue and the true path RTT now, and picks the node with the
  least predicted TTFT among those serving the model (the bound the others are measured against).
- `oracle_spread`: the oracle, its first pick the node with the fewest requests not started
  among those within `ORACLE_SPREAD` of the best prediction.
- `oracle_meridian`: `meridian`'s own routing on the true state: every node beats 20 times a
  second, with no delay to the control plane or the PoPs (simulator/run.py). Greedy oracles keep
  a surge near its source while a node there predicts better than a far round trip, and each
  request they add lengthens every step of the batch it joins; `meridian` counts what it sent
  and spills sooner, so the bound needs its rule too.
Every policy but `nearest` fails over in the order it gave, as the gateway does. Each plans for
one model at a time, among the regions serving it (with a model-blind summary document: all),
on the numbers of its nodes there; the gateway's fallback to another model is simulator/flow.py's.
"""

from __future__ import annotations

import dataclasses
import heapq
import ipaddress
import itertools
import random
from collections.abc import Callable, Collection, Iterable, Mapping
from functools import partial
from typing import Final, NamedTuple

from control_plane.dns.config import DnsConfig
from control_plane.dns.steering import Steering
from gateway.attempts import Try
from gateway.plan_checks import has_capacity
from gateway.routing import Router, RouterConfig, SummaryLoads
from gateway.settings import GatewaySettings
from simulator.control import PopWatch
from simulator.node import Node
from simulator.site import Site
from simulator.workload import Request
from simulator.world import Geography
from wire.geo import IPNetwork, client_subnet_of
from wire.region_summary import ModelLoad, RegionSummary, RegionSummaryIndex

POLICIES: Final = (
    "meridian", "round_robin", "nearest", "least_loaded", "oracle", "oracle_spread",
    "oracle_meridian",
)  # fmt: skip
# The near-best band of `oracle_spread`, as wide as the gateway's default `p2c_tolerance`.
ORACLE_SPREAD: Final = 0.2


def default_router_config() -> RouterConfig:
    """The RouterConfig a gateway builds from its settings' defaults (gateway/app.py)."""
    defaults = GatewaySettings.model_fields
    values = {f.name: defaults[f.name].default for f in dataclasses.fields(RouterConfig)}
    return RouterConfig(**values)


class Pick(NamedTuple):  # a tuple, not a frozen dataclass: made ~10 times per request
    region: str
    predicted_ttft_s: float = 0.0
    node: Node | None = None  # the oracle also picks the node
    # Whether the plan it is part of has capacity (meridian's: gateway.plan_checks.has_capacity;
    # the other policies plan only what they take to have it).
    has_capacity: bool = True
    cached_tokens: int = 0  # of the prompt, what meridian's plan took as cached there


class Chooser:
    """A policy: the regions to try for a request, and what it learns from the attempts."""

    is_via_pop = True  # clients reach it through their Anycast PoP
    needs_control_plane = True  # it decides on heartbeats and summaries
    max_attempts: int | None = None  # None: the gateway's setting

    def order(
        self, pop: str, request: Request, now_s: float, limit: int, exclude: Collection[str] = ()
    ) -> list[Pick]:
        """At most `limit` regions to try for the request's model, best first, none of `exclude`
        (those the request tried before a resume); empty if none can take the request."""
        raise NotImplementedError

    def on_attempt(self, pop: str, step: Try, now_s: float) -> None:
        return None

    def on_failure(self, pop: str, step: Try, now_s: float) -> None:
        return None

    def on_first_byte(self, pop: str, step: Try, now_s: float) -> None:
        return None

    def on_end(self, pop: str, region: str, is_broken: bool, now_s: float) -> None:
        """An attempt's stream ended there: done, or broken after its first byte."""
        return None

    def on_ttft(
        self, pop: str, pick: Pick, ttft_s: float, cached_tokens: int, now_s: float
    ) -> None:
        """The request is over; `pick` sent its first byte, `ttft_s` after that attempt left."""
        return None


def nodes_for(summary: RegionSummary, model: str | None) -> RegionSummary | ModelLoad | None:
    """The numbers of the region's nodes serving `model` (None: the region's totals, for a
    model-blind document), None if it lists no node serving it."""
    if model is None:
        return summary
    return next((m for m in summary.models if m.name == model), None)


def planned_model(document: RegionSummaryIndex, model: str) -> str | None:
    """What a gateway plans for: the model, or None (every region) from a version 1 document."""
    return model if document.is_model_aware else None


def _serving(
    watch: PopWatch, now_s: float, exclude: Collection[str], model: str
) -> list[tuple[RegionSummary, RegionSummary | ModelLoad]]:
    """The regions serving `model` in the PoP's summaries now, with its nodes' numbers there,
    less `exclude` (none before the first)."""
    document = watch.read(now_s)
    if document is None:
        return []
    planned = planned_model(document, model)
    serving = []
    for summary in document.regions:
        nodes = nodes_for(summary, planned)
        is_serving = summary.state == "active" and nodes is not None and nodes.healthy_nodes > 0
        if is_serving and summary.name not in exclude:
            assert nodes is not None
            serving.append((summary, nodes))
    return serving


class MeridianChooser(Chooser):
    """The gateway's routing: every decision is the real Router's and breaker's."""

    def __init__(
        self, watches: Mapping[str, PopWatch], geography: Geography, config: RouterConfig, seed: int
    ) -> None:
        self.watches = watches
        loads = SummaryLoads()  # the PoPs adopt the same documents: one load per summary
        self.routers = {
            pop: Router(config, place, rng=random.Random(f"router/{seed}/{pop}"), loads=loads)
            for pop, place in geography.pops.items()
        }

    def order(
        self, pop: str, request: Request, now_s: float, limit: int, exclude: Collection[str] = ()
    ) -> list[Pick]:
        router = self.routers[pop]
        document = self.watches[pop].read(now_s)
        if document is None:
            return []
        if not router.is_loaded or document.index != router.index:
            router.update(document)
        planned = planned_model(document, request.model)
        key, prefix_tokens = request.affinity_key, request.prefix_tokens
        plan = router.plan(request.prompt_tokens, key, now_s, exclude, planned, prefix_tokens)
        room = has_capacity(plan)
        return [
            Pick(c.region, c.predicted_ttft_s, None, room, c.cached_tokens)
            for c in plan.candidates[:limit]
        ]

    def on_attempt(self, pop: str, step: Try, now_s: float) -> None:
        state = self.routers[pop].state_of(step.candidate.region)
        if state is not None:
            state.breaker.on_attempt(now_s)
            state.on_sent(step.awaited_tokens)

    def on_failure(self, pop: str, step: Try, now_s: float) -> None:
        state = self.routers[pop].state_of(step.candidate.region)
        if state is not None:
            state.on_no_first_byte(step.awaited_tokens)
            state.breaker.on_failure(now_s)

    def on_first_byte(self, pop: str, step: Try, now_s: float) -> None:
        state = self.routers[pop].state_of(step.candidate.region)
        if state is not None:
            state.on_first_byte(step.awaited_tokens)
            state.breaker.on_success()

    def on_end(self, pop: str, region: str, is_broken: bool, now_s: float) -> None:
        state = self.routers[pop].state_of(region)
        if state is not None:
            state.num_in_flight -= 1
            if is_broken:  # as gateway/resume.py, or gateway/api.py at an error event
                state.breaker.on_failure(now_s)

    def on_ttft(
        self, pop: str, pick: Pick, ttft_s: float, cached_tokens: int, now_s: float
    ) -> None:
        self.routers[pop].observe_ttft(
            pick.region, ttft_s, pick.predicted_ttft_s, cached_tokens=cached_tokens, now_s=now_s
        )


class RoundRobinChooser(Chooser):
    def __init__(self, watches: Mapping[str, PopWatch]) -> None:
        self.watches = watches
        self.turn = dict.fromkeys(watches, 0)

    def order(
        self, pop: str, request: Request, now_s: float, limit: int, exclude: Collection[str] = ()
    ) -> list[Pick]:
        serving = _serving(self.watches[pop], now_s, exclude, request.model)
        names = [summary.name for summary, _ in serving]
        if not names:
            return []
        turn = self.turn[pop] % len(names)
        self.turn[pop] += 1
        return [Pick(name) for name in (names[turn:] + names[:turn])[:limit]]


class LeastLoadedChooser(Chooser):
    def __init__(self, watches: Mapping[str, PopWatch]) -> None:
        self.watches = watches
        self.in_flight: dict[tuple[str, str], int] = {}

    def order(
        self, pop: str, request: Request, now_s: float, limit: int, exclude: Collection[str] = ()
    ) -> list[Pick]:
        def load(
            serving: tuple[RegionSummary, RegionSummary | ModelLoad],
        ) -> tuple[float, float, float, str]:
            summary, nodes = serving
            used = 0.0
            if nodes.kv_blocks_total:
                used = 1.0 - nodes.kv_blocks_free / nodes.kv_blocks_total
            mine = self.in_flight.get((pop, summary.name), 0) / nodes.healthy_nodes
            return nodes.queue.expected_queue_delay_s, used, mine, summary.name

        serving = _serving(self.watches[pop], now_s, exclude, request.model)
        serving.sort(key=load)
        return [Pick(summary.name) for summary, _ in serving[:limit]]

    def on_attempt(self, pop: str, step: Try, now_s: float) -> None:
        key = (pop, step.candidate.region)
        self.in_flight[key] = self.in_flight.get(key, 0) + 1

    def on_failure(self, pop: str, step: Try, now_s: float) -> None:
        self.in_flight[(pop, step.candidate.region)] -= 1

    def on_end(self, pop: str, region: str, is_broken: bool, now_s: float) -> None:
        self.in_flight[(pop, region)] -= 1


class NearestChooser(Chooser):
    """Geo-DNS: the control plane's steering, behind resolver caches (one per client city). For a
    model, the steering answers among the regions serving it, as if each model had a hostname of
    its own (the control plane's DNS has none: this is kinder to geo-DNS than it is today)."""

    is_via_pop = False
    max_attempts = 1

    def __init__(
        self, read_summaries: Callable[[], RegionSummaryIndex], cities: Iterable[str]
    ) -> None:
        self.config = DnsConfig()
        # The DNS server runs in the control plane: it reads the current summaries, no watch.
        self.read_summaries = read_summaries
        self.steerings: dict[str, Steering] = {}  # by model: each its own shedding state
        self.views: dict[str, RegionSummaryIndex] = {}  # by model: the latest document's
        self.networks: dict[str, IPNetwork] = {
            city: ipaddress.ip_network(client_subnet_of(city)) for city in cities
        }
        # (city, model) → (region, expires at)
        self.cache: dict[tuple[str, str], tuple[str, float]] = {}

    def view_for(self, model: str) -> RegionSummaryIndex:
        """The current document as a hostname for `model` sees it: the regions serving it, each
        with the numbers of its nodes serving it."""
        document = self.read_summaries()
        if planned_model(document, model) is None:
            return document
        view = self.views.get(model)
        if view is None or view.index != document.index:
            regions = []
            for summary in document.regions:
                nodes = nodes_for(summary, model)
                if nodes is not None:
                    numbers = ("healthy_nodes", "kv_blocks_free", "kv_blocks_total", "queue")
                    update = {name: getattr(nodes, name) for name in numbers}
                    regions.append(summary.model_copy(update=update))
            view = self.views[model] = document.model_copy(update={"regions": regions})
        return view

    def answer(self, city: str, model: str, now_s: float) -> str | None:
        cached = self.cache.get((city, model))
        if cached is not None and now_s < cached[1]:
            return cached[0]
        steering = self.steerings.get(model)
        if steering is None:
            steering = self.steerings[model] = Steering(self.config, partial(self.view_for, model))
        decision = steering.decide(self.networks[city])
        if decision is None:
            return None
        self.cache[(city, model)] = (decision.target.name, now_s + self.config.ttl_s)
        return decision.target.name

    def order(
        self, pop: str, request: Request, now_s: float, limit: int, exclude: Collection[str] = ()
    ) -> list[Pick]:
        region = self.answer(request.city, request.model, now_s)
        return [] if region is None else [Pick(region)]


class OracleChooser(Chooser):
    """Every node's true queue now, plus what this oracle already sent that is still on the
    wire to it (so that it does not herd within one RTT)."""

    needs_control_plane = False  # it reads the nodes themselves

    def __init__(
        self, sites: Mapping[str, Site], geography: Geography, spread: float = 0.0
    ) -> None:
        self.sites = sites
        self.geography = geography
        self.spread = spread
        self._rtt_s: dict[tuple[str, str], float] = {}
        self._on_the_way: list[tuple[float, int, str, int]] = []  # heap: arrival, seq, node, tokens
        self._incoming: dict[str, tuple[int, int]] = {}  # node → (requests, prompt tokens)
        self._sequence = itertools.count()

    def rtt_s(self, pop: str, site: Site) -> float:
        key = (pop, site.name)
        rtt_s = self._rtt_s.get(key)
        if rtt_s is None:
            here = self.geography.pops[pop]
            rtt_s = self._rtt_s[key] = self.geography.true_rtt_ms(here, site.location) / 1000.0
        return rtt_s

    def _arrived_by(self, now_s: float) -> None:
        heap = self._on_the_way
        while heap and heap[0][0] <= now_s:
            _, _, name, tokens = heapq.heappop(heap)
            num, total = self._incoming[name]
            self._incoming[name] = (num - 1, total - tokens)

    def order(
        self, pop: str, request: Request, now_s: float, limit: int, exclude: Collection[str] = ()
    ) -> list[Pick]:
        self._arrived_by(now_s)
        model = request.model
        picks = []
        # Once per request, not once per node (`affinity_key` and `prefix_tokens` are properties).
        prompt_tokens = request.prompt_tokens
        key, prefix_tokens = request.affinity_key, request.prefix_tokens
        incoming = self._incoming
        for site in self.sites.values():
            if not site.is_up or site.name in exclude:
                continue
            rtt_s = self.rtt_s(pop, site)
            best: tuple[float, Node] | None = None
            for node in site.serving.get(model, ()):
                if not node.is_up:
                    continue
                num, tokens = incoming.get(node.name, (0, 0))
                ttft_s = node.predict_ttft_s(prompt_tokens, key, prefix_tokens, now_s, num, tokens)
                if best is None or ttft_s < best[0]:
                    best = (ttft_s, node)
            if best is not None:
                picks.append(Pick(site.name, rtt_s + best[0], best[1]))
        picks.sort(key=lambda pick: pick.predicted_ttft_s)
        if picks and self.spread > 0.0:
            picks = self._spread(picks)
        if picks:  # the first is sent now: it reaches its node half an RTT from now
            first, target = picks[0], picks[0].node
            assert target is not None
            arrive_s = now_s + self.rtt_s(pop, self.sites[first.region]) / 2.0
            entry = (arrive_s, next(self._sequence), target.name, request.prompt_tokens)
            heapq.heappush(self._on_the_way, entry)
            num, tokens = self._incoming.get(target.name, (0, 0))
            self._incoming[target.name] = (num + 1, tokens + request.prompt_tokens)
        return picks[:limit]

    def _spread(self, picks: list[Pick]) -> list[Pick]:
        """`picks` (by predicted TTFT) with the first chosen among the near-best (within
        `spread` of the best) as the one whose node has the fewest requests not started yet,
        those on their way to it included: a surge spread before queues show it."""
        limit_s = picks[0].predicted_ttft_s * (1.0 + self.spread)
        near = [pick for pick in picks if pick.predicted_ttft_s <= limit_s]
        if len(near) == 1:
            return picks

        def waiting(pick: Pick) -> tuple[int, float]:
            assert pick.node is not None
            num_incoming = self._incoming.get(pick.node.name, (0, 0))[0]
            return pick.node.num_not_started + num_incoming, pick.predicted_ttft_s

        chosen = min(near, key=waiting)
        return [chosen, *(pick for pick in picks if pick is not chosen)]
