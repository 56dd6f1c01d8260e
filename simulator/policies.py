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
  and spills sooner, so the bound needs its rule too. Its regions' pickers are not told the
  next-best region (wire/deflection.py): sending a request back mends stale summaries, which it
  has none of, and with it the bound only loosened (CPU `surge` seed 1: 0.370 -> 0.375 s).
- `oracle_direct`: `nearest` made clairvoyant: straight to the region the client's own public
  path reaches soonest, among those up and serving the model (simulator/oracle.py).
Every policy but `nearest` fails over in the order it gave, as the gateway does. Each plans for
one model at a time, among the regions serving it (with a model-blind summary document: all),
on the numbers of its nodes there; the gateway's fallback to another model is simulator/flow.py's.
"""

from __future__ import annotations

import dataclasses
import ipaddress
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
from simulator.workload import Request
from simulator.world import Geography
from wire.geo import IPNetwork, client_subnet_of
from wire.region_summary import ModelLoad, RegionSummary, RegionSummaryIndex

POLICIES: Final = (
    "meridian", "round_robin", "nearest", "least_loaded", "oracle", "oracle_spread",
    "oracle_meridian", "oracle_direct",
)  # fmt: skip


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
    # Meridian's first pick: what its plan's next-best region costs (RoutePlan.alternative_s).
    alternative_s: float | None = None


class Chooser:
    """A policy: the regions to try for a request, and what it learns from the attempts."""

    is_via_pop = True  # clients reach it through their Anycast PoP
    # It retries, falls back to another model and resumes streams as the gateway does (else
    # each client sends once, to one region).
    has_gateway = True
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

    def on_deflected(self, pop: str, step: Try, now_s: float) -> None:
        """The region's picker sent the attempt back (only meridian's carry an alternative)."""
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
        self,
        watches: Mapping[str, PopWatch],
        geography: Geography,
        config: RouterConfig,
        seed: int,
        tells_alternative: bool = True,
    ) -> None:
        self.watches = watches
        self.tells_alternative = tells_alternative  # the first pick's (RoutePlan.alternative_s)
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
        picks = [
            Pick(c.region, c.predicted_ttft_s, None, room, c.cached_tokens)
            for c in plan.candidates[:limit]
        ]
        if picks and self.tells_alternative:
            picks[0] = picks[0]._replace(alternative_s=plan.alternative_s)
        return picks

    def on_attempt(self, pop: str, step: Try, now_s: float) -> None:
        state = self.routers[pop].state_of(step.candidate.region)
        if state is not None:
            state.breaker.on_attempt(now_s)
            state.on_sent(step.awaited_tokens)

    def on_deflected(self, pop: str, step: Try, now_s: float) -> None:
        state = self.routers[pop].state_of(step.candidate.region)
        if state is not None:  # as gateway/proxy.py
            state.on_no_first_byte(step.awaited_tokens)
            state.breaker.on_success()

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
    has_gateway = False
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
