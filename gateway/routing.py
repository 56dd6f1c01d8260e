"""Choosing the region that will answer a request soonest, and the order to fail over in.

A region's cost is its expected time to first token from this PoP, in seconds:

    cost = rtt_weight * rtt_ms / 1000                  network round trip (wire/geo.py)
         + queue_weight * (queue_delay_s               prompt tokens ahead / the region's prefill
                           + awaited_s                 prompts sent there, no first byte yet
                           + kv_pressure_s)            a fuller KV cache: slower steps
         + prompt_tokens / prefill_tokens_per_s        this request's own prefill, at the rate
                                                       the region's nodes report (else the
                                                       mean the fleet's nodes of the model
                                                       report, else the gateway's setting)
         - cached_prefix_s                             its system prompt's prefill where the
                                                       region's digest lists it (see below)
         + ttft_correction_s                           EWMA of (observed - predicted) TTFT here

never less than the RTT term. The queue delay counts every prompt token the region's nodes
have still to prefill, waiting or admitted (an admitted one's prefill may be far off behind
others': a load surge shows up there long before requests wait for a slot), over the nodes'
prefill rate, or the summary's own estimate (waiting tokens over the decode rate) if longer.
The prompts this gateway sent the region with no first byte yet are queue too (less what was
taken as cached: a tenant's hits would push it off the region holding its prompt): the
summaries show them a beat later, and in between a surge, or a failed region's work, would all
go to the one region that looked idle.
A system prompt the region's nodes served lately (its key among the summary's hot prefixes) is
likely cached there: its prefill comes off the cost if at least MIN_CACHED_PREFILL_S (worth a
farther trip; a shorter one, cheap to miss once, drew tenants to the region that served them
first, and then crowded it: simulated calm days' p99 4-6% worse).
The correction learns what the summaries miss (a slow network path, a slower node type) from
the TTFT this gateway measures on streams (not on those a grammar constrains: their TTFT holds
the grammar's compile, which says nothing of the region), and decays with a half-life so a
region it once judged slow is tried again; a region not measured yet takes the residual over
all the regions measured (what every prediction misses), not 0. It is fed when a stream ends,
not at its first token (which reacts to the same stale queue twice). A stream's prefix-cache
hits, as its node's usage reports them, come off its prediction before the residual is taken:
a region measured on hits would otherwise look cheaper for every prompt, and so would the
regions not measured yet.

A plan for a model (`plan(..., model=...)`) is made among the regions whose summary lists it,
each costed on the numbers of its nodes serving that model (healthy nodes, KV cache, queue)
rather than the region's totals; the breaker, the in-flight counts and the TTFT correction stay
the region's. The summary-derived part is worked out once per document for each region and
model planned for (gateway/summary_loads.py), so that a catalog of many models costs nothing
per request.

Eligible regions are active, with healthy nodes (for a model: serving it), an ingress URL and a
weight above 0. Among those, saturated ones (KV cache fuller than the policy's threshold) and
ones whose circuit is open go last; below the threshold, KV use costs from `KV_PRESSURE_KNEE` of
it on. The first choice is made among the near-best (cost within `p2c_tolerance` of the best,
plus a small absolute slack): with affinity on and a system prompt, among the near-best regions
whose summaries list the prompt's key among their hot prefixes (wire/prefix_key.py: their nodes
served it lately, so their caches hold it) those with the most such nodes ("cached"), else all
of them ("affinity"), by rendezvous hashing of its hash (the same prompt lands on the same
region while that region stays near-best, so its prefix cache is warm); otherwise by the power
of two choices, picking the one of two random near-best regions where fewer of this gateway's
requests per healthy node still wait for their first byte, so that gateways do not all stampede
onto the single best region. (Requests in flight would count long streams that are past their
prefill: the nearest region always has the most, so two choices drifted to the farther region
even when neither had a queue.) The rest follow by cost, for failover. The first attempt tells
the chosen region what the next-best preferred region costs (`RoutePlan.alternative_s`): the
region's picker, which sees each node, sends the request back when its best node is further
from a first token than that (wire/deflection.py).
"""

from __future__ import annotations

import functools
import hashlib
import math
import operator
import random
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Literal

from gateway.breaker import CircuitBreaker
from gateway.model_routes import ModelRoutes
from gateway.region_state import RegionState
from gateway.summary_loads import (
    SummaryLoad,
    SummaryLoads,
    kv_pressure_s,
    queue_delay_s,
    unreported_prefill_rates,
)
from wire.geo import Place, rtt_ms
from wire.region_summary import RegionSummary, RegionSummaryIndex
from wire.routing_policy import RoutingPolicy

Reason = Literal["only", "p2c", "cached", "affinity", "fallback"]


@dataclass(frozen=True, slots=True)
class RouterConfig:
    prefill_tokens_per_s: float
    ttft_ewma_alpha: float
    ttft_correction_half_life_s: float
    near_best_slack_s: float
    breaker_failures: int
    breaker_open_s: float


@dataclass(frozen=True, slots=True)
class Candidate:
    region: str
    url: str  # the region's ingress, without a trailing slash
    cost_s: float
    predicted_ttft_s: float  # before the correction: what the observed TTFT is compared with
    rtt_ms: float  # expected, this PoP to the region (wire/geo.py): what a connect may take
    prompt_tokens: int  # what it was costed for
    cached_tokens: int = 0  # of those, what its cost took as cached there (below)


@dataclass(frozen=True, slots=True)
class RoutePlan:
    candidates: list[Candidate]  # the choice first, then failover order
    reason: Reason
    # What the next-best region costs, told the first region so that its picker may send the
    # request back when none of its nodes would beat it (wire/deflection.py); None: no such
    # region, or its cost took a cached system prompt off (a guess from its digest: tenants
    # sent back on it prefilled their prompts cold elsewhere).
    alternative_s: float | None = None


_cost_s = operator.attrgetter("cost_s")
# The least cached prefill taken off a region's cost (above): about the longest PoP-region RTT.
MIN_CACHED_PREFILL_S = 0.25
MAX_CACHED_RENDEZVOUS = 4096  # (system prompt hash, region) pairs


@functools.lru_cache(maxsize=MAX_CACHED_RENDEZVOUS)
def _rendezvous_log(key: str, region: str) -> float:
    """log of the key's hash on the region, mapped into (0, 1): the same for every request of a
    system prompt (cached: a gateway hashes the same few keys over and over)."""
    digest = hashlib.blake2b(f"{key}/{region}".encode(), digest_size=8).digest()
    return math.log((int.from_bytes(digest, "big") + 1) / (2**64 + 1))


def _rendezvous_score(key: str, region: str, weight: float) -> float:
    return -weight / _rendezvous_log(key, region)


@dataclass(slots=True)
class Router:
    config: RouterConfig
    pop: Place  # where this gateway stands
    rng: random.Random = field(default_factory=random.Random)
    policy: RoutingPolicy = field(default_factory=RoutingPolicy)
    regions: dict[str, RegionState] = field(default_factory=dict)
    index: int = 0
    is_loaded: bool = False
    loads: SummaryLoads = field(default_factory=SummaryLoads)  # may be shared with other routers
    models: ModelRoutes = field(default_factory=ModelRoutes.blind)  # the document's model names
    # The prefill rate assumed for nodes that report none, by model (None: a region's totals).
    unreported_rates: dict[str | None, float] = field(default_factory=dict)
    # The residual over every region's samples: what a region not measured yet is assumed to
    # be off by (the error every prediction shares, e.g. the first token's decode step).
    ttft_residual_s: float = 0.0
    residual_at_s: float = 0.0
    num_ttft_samples: int = 0

    def update(self, document: RegionSummaryIndex) -> None:
        """Adopt a new summary document, keeping what was learnt about known regions."""
        regions: dict[str, RegionState] = {}
        for summary in document.regions:
            known = self.regions.get(summary.name)
            if known is None:
                breaker = CircuitBreaker(
                    f"region {summary.name}",
                    self.config.breaker_failures,
                    self.config.breaker_open_s,
                )
                known = RegionState(summary, rtt_ms(self.pop, summary), breaker)
            elif (known.summary.lat, known.summary.lon) != (summary.lat, summary.lon):
                known.rtt_ms = rtt_ms(self.pop, summary)
            known.adopt(summary)
            regions[summary.name] = known
        self.regions = regions
        self.policy = document.routing
        self.models = ModelRoutes.of(document, self.models)
        self.unreported_rates = unreported_prefill_rates(
            document.regions, self.config.prefill_tokens_per_s
        )
        self.index = document.index
        self.is_loaded = True

    def correction_s(self, state: RegionState, now_s: float) -> float:
        if state.num_ttft_samples == 0:
            return self.prior_correction_s(now_s)
        age_s = max(0.0, now_s - state.residual_at_s)
        return state.ttft_residual_s * 0.5 ** (age_s / self.config.ttft_correction_half_life_s)

    def prior_correction_s(self, now_s: float) -> float:
        """The correction of a region this gateway has no TTFT from yet: the residual over every
        region's samples (left at 0, a new region would look cheaper than the measured ones by
        what the predictions miss everywhere, and draw work across oceans)."""
        if self.num_ttft_samples == 0:
            return 0.0
        age_s = max(0.0, now_s - self.residual_at_s)
        return self.ttft_residual_s * 0.5 ** (age_s / self.config.ttft_correction_half_life_s)

    def unreported_rate(self, model: str | None = None) -> float:
        """Prompt tokens per second assumed for `model`'s nodes that report no rate."""
        rates = self.unreported_rates
        return rates.get(model) or rates.get(None) or self.config.prefill_tokens_per_s

    def queue_delay_s(self, summary: RegionSummary) -> float:
        return queue_delay_s(summary, self.unreported_rate())

    def kv_pressure_s(self, summary: RegionSummary) -> float:
        return kv_pressure_s(summary, self.policy)

    def load_of(self, state: RegionState) -> SummaryLoad:
        if state.load is None:
            prefill_tokens_per_s = self.unreported_rate()
            state.load = self.loads.load_of(state.summary, self.policy, prefill_tokens_per_s)
        return state.load

    def model_load_of(self, state: RegionState, model: str) -> SummaryLoad | None:
        """The region's load on `model`'s nodes (None: the region does not list it)."""
        load = state.model_loads.get(model)
        if load is None:
            nodes = state.models.get(model)
            if nodes is None:
                return None
            prefill_tokens_per_s = self.unreported_rate(model)
            load = self.loads.load_of(state.summary, self.policy, prefill_tokens_per_s, nodes)
            state.model_loads[model] = load
        return load

    def predict(self, state: RegionState, prompt_tokens: int, now_s: float) -> Candidate:
        return self._candidate(state, self.load_of(state), prompt_tokens, now_s)

    def _candidate(
        self,
        state: RegionState,
        load: SummaryLoad,
        prompt_tokens: int,
        now_s: float,
        cached_tokens: int = 0,
    ) -> Candidate:
        prefill_s = prompt_tokens / load.prefill_tokens_per_s
        cached_tokens = min(cached_tokens, prompt_tokens)
        cached_s = cached_tokens / load.prefill_tokens_per_s
        if cached_s < MIN_CACHED_PREFILL_S:
            cached_tokens, cached_s = 0, 0.0  # not worth a trip (above)
        policy = self.policy
        rtt_s = state.rtt_ms / 1000.0
        weighted_rtt_s = policy.rtt_weight * rtt_s
        # What this gateway sent here, not answered yet: the summaries show it a beat later.
        awaited_s = max(0, state.awaited_tokens) / load.prefill_capacity_tokens_per_s
        cost_s = weighted_rtt_s + policy.queue_weight * (load.load_s + awaited_s) + prefill_s
        cost_s -= cached_s
        if self.num_ttft_samples:  # else no region has a correction yet
            cost_s += self.correction_s(state, now_s)
        if cost_s < weighted_rtt_s:  # never less than the RTT term
            cost_s = weighted_rtt_s
        predicted_s = rtt_s + load.queue_s + awaited_s + prefill_s
        name = state.summary.name
        return Candidate(
            name, load.url, cost_s, predicted_s, state.rtt_ms, prompt_tokens, cached_tokens
        )

    def plan(
        self,
        prompt_tokens: int,
        affinity_key: str | None = None,
        now_s: float | None = None,
        exclude: Collection[str] = (),
        model: str | None = None,
        prefix_tokens: int = 0,
    ) -> RoutePlan:
        """Regions to try, best first; empty if no region may take new work. `now_s` is the
        monotonic clock unless given (the simulator drives the router on its own clock);
        `exclude`: regions this request has tried already (a resume chooses among the rest).
        `model`: plan among the regions that serve it, each costed on its nodes for that
        model (None: model-blind, on the region totals). `prefix_tokens`: the system prompt's
        part of the prompt (`affinity_key` names it)."""
        now_s = time.monotonic() if now_s is None else now_s
        preferred: list[Candidate] = []
        others: list[Candidate] = []
        for name, state in self.regions.items():
            if name in exclude:
                continue
            load: SummaryLoad | None
            if model is None:
                load = state.load if state.load is not None else self.load_of(state)
            else:
                load = self.model_load_of(state, model)
            if load is None or not load.is_eligible:
                continue
            cached = prefix_tokens if state.nodes_holding(model, affinity_key) else 0
            candidate = self._candidate(state, load, prompt_tokens, now_s, cached)
            is_preferred = not load.is_saturated and state.breaker.is_available(now_s)
            (preferred if is_preferred else others).append(candidate)
        preferred.sort(key=_cost_s)
        others.sort(key=_cost_s)
        if not preferred:
            return RoutePlan(others, "fallback")
        if len(preferred) == 1:
            return RoutePlan(preferred + others, "only")
        limit_s = preferred[0].cost_s * (1.0 + self.policy.p2c_tolerance)
        near = [c for c in preferred if c.cost_s <= limit_s + self.config.near_best_slack_s]
        reason: Reason
        if len(near) == 1:
            chosen, reason = near[0], "only"
        elif affinity_key is not None and self.policy.affinity_enabled:
            holding = self._holding(near, affinity_key, model)
            if holding:
                chosen, reason = self._by_affinity(holding, affinity_key), "cached"
            else:
                chosen, reason = self._by_affinity(near, affinity_key), "affinity"
        else:
            chosen, reason = self._by_two_choices(near), "p2c"
        rest = [c for c in preferred if c is not chosen]
        alternative_s = rest[0].cost_s if not rest[0].cached_tokens else None
        return RoutePlan([chosen, *rest, *others], reason, alternative_s)

    def _weight(self, candidate: Candidate) -> float:
        return self.regions[candidate.region].summary.weight

    def _holding(self, near: list[Candidate], key: str, model: str | None) -> list[Candidate]:
        """Those of `near` whose summaries say the most of their nodes hold `key`."""
        counts = [self.regions[c.region].nodes_holding(model, key) for c in near]
        most = max(counts)
        return [c for c, n in zip(near, counts, strict=True) if n == most] if most else []

    def _by_affinity(self, near: list[Candidate], key: str) -> Candidate:
        return max(near, key=lambda c: _rendezvous_score(key, c.region, self._weight(c)))

    def _by_two_choices(self, near: list[Candidate]) -> Candidate:
        first, second = self.rng.sample(near, 2)

        def load(candidate: Candidate) -> tuple[float, float]:
            state = self.regions[candidate.region]
            capacity = state.summary.weight * state.summary.healthy_nodes
            return state.num_awaiting_first_byte / capacity, candidate.cost_s

        return min(first, second, key=load)

    # Feedback from the proxy.

    def summary_of(self, region: str) -> RegionSummary | None:
        """The region's summary as held (None: a region not in it)."""
        state = self.regions.get(region)
        return None if state is None else state.summary

    def state_of(self, region: str) -> RegionState | None:
        return self.regions.get(region)

    def serving_key_of(self, region: str, model: str) -> str | None:
        """What the region's nodes for `model` write, when they all write the same (None: the
        region does not list the model, its nodes did not say, or they differ)."""
        state = self.regions.get(region)
        nodes = None if state is None else state.models.get(model)
        if nodes is None or len(nodes.serving_keys) != 1:
            return None
        return nodes.serving_keys[0]

    def observe_ttft(
        self,
        region: str,
        ttft_s: float,
        predicted_s: float,
        cached_tokens: int = 0,
        now_s: float | None = None,
    ) -> None:
        """A stream's TTFT against its prediction. The prediction charged the whole prompt's
        prefill; `cached_tokens` (the node's usage) were prefix-cache hits, so they come off
        the prediction: the residual is what the summaries miss, not where a prompt happened
        to be cached (a region measured on hits would look cheap for every prompt)."""
        state = self.regions.get(region)
        if state is None:
            return
        now_s = time.monotonic() if now_s is None else now_s
        rate = self.load_of(state).prefill_tokens_per_s  # the region's, as predicted
        sample_s = ttft_s - (predicted_s - cached_tokens / rate)
        alpha = self.config.ttft_ewma_alpha
        if self.num_ttft_samples == 0:
            self.ttft_residual_s = sample_s
        else:
            self.ttft_residual_s = (1 - alpha) * self.prior_correction_s(now_s) + alpha * sample_s
        self.residual_at_s = now_s
        self.num_ttft_samples += 1
        if state.num_ttft_samples == 0:
            state.ttft_residual_s = sample_s
        else:
            state.ttft_residual_s = (1 - alpha) * self.correction_s(state, now_s) + alpha * sample_s
        state.residual_at_s = now_s
        state.num_ttft_samples += 1
