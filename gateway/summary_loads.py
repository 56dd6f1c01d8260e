"""The part of a region's routing cost that only its summary and the policy set: the same at
every PoP, so worked out once per summary document, not once per request (a gateway plans far
more often), and shared between gateways that adopt the same document (`SummaryLoads`).

A region is costed on its totals (a model-blind plan) or on one model's numbers in it (the
nodes serving that model: their healthy count, KV cache and queue, `ModelLoad`); both are a
`NodeLoad`. The region's own state, ingress and weight decide eligibility either way.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from statistics import fmean
from typing import Protocol

from wire.region_summary import ModelLoad, QueueEstimate, RegionSummary
from wire.routing_policy import RoutingPolicy

# A fuller KV cache means bigger batches and slower steps, so a rising cost rather than a cliff:
# 0 up to KNEE x the policy's saturation threshold, then linear up to KV_PRESSURE_S at it (values
# tuned in the simulator; see docs/simulator.md). Past the threshold the region also goes last.
KV_PRESSURE_KNEE = 0.7
KV_PRESSURE_S = 0.1
# Enough for every PoP's document (a load per region and model) while they lag one another
# by a few ticks.
MAX_SHARED_LOADS = 4096


class NodeLoad(Protocol):
    """Numbers over some of a region's nodes: all of them (`RegionSummary`), or those serving
    one model (`ModelLoad`)."""

    @property
    def healthy_nodes(self) -> int: ...

    @property
    def kv_blocks_free(self) -> int: ...

    @property
    def kv_blocks_total(self) -> int: ...

    @property
    def queue(self) -> QueueEstimate: ...


@dataclass(frozen=True, slots=True)
class SummaryLoad:
    is_eligible: bool
    is_saturated: bool  # KV cache fuller than the policy's threshold
    queue_s: float
    load_s: float  # the queue and KV pressure terms, before `queue_weight`
    url: str
    prefill_tokens_per_s: float  # per node: the rate its nodes report, else the assumed one
    prefill_capacity_tokens_per_s: float  # that over its healthy nodes (at least one)


def prefill_rate_of(nodes: NodeLoad, default_tokens_per_s: float) -> float:
    """Prompt tokens per second one of these nodes prefills: the mean rate they report (node
    types differ from region to region), else the gateway's fleet-wide setting."""
    reported = nodes.queue.prefill_tokens_per_s
    return default_tokens_per_s if reported is None else reported


def unreported_prefill_rates(
    regions: Iterable[RegionSummary], setting_tokens_per_s: float
) -> dict[str | None, float]:
    """The prefill rate to assume where nodes report none (a node measures its rate only once
    it has prefilled): the mean of the rates reported for the same model (under None: of the
    regions' totals), else the gateway's setting. Priced at the setting beside measured regions,
    a region that has not served yet looked faster or slower than they did by whatever the
    setting misses on this hardware, and drew or lost work for that alone."""
    reported: dict[str | None, list[float]] = {}
    for summary in regions:
        named: list[tuple[str | None, NodeLoad]] = [(None, summary)]
        named += [(model.name, model) for model in summary.models]
        for name, nodes in named:
            rate = nodes.queue.prefill_tokens_per_s
            if rate is not None:
                reported.setdefault(name, []).append(rate)
    fleet = fmean(reported.pop(None)) if None in reported else setting_tokens_per_s
    return {None: fleet} | {name: fmean(rates) for name, rates in reported.items()}


def queue_delay_s(nodes: NodeLoad, prefill_tokens_per_s: float) -> float:
    """Seconds before a new request's own prefill starts: the prompt tokens ahead of it in the
    region (waiting, and admitted but not yet prefilled), spread over its nodes at the rate
    they report (else `prefill_tokens_per_s`), or the summary's own estimate of the wait for a
    free slot, whichever is longer."""
    queue = nodes.queue
    backlog_tokens = queue.num_waiting_prefill_tokens + queue.num_running_prefill_tokens
    rate = prefill_capacity_of(nodes, prefill_tokens_per_s)
    return max(queue.expected_queue_delay_s, backlog_tokens / rate)


def prefill_capacity_of(nodes: NodeLoad, prefill_tokens_per_s: float) -> float:
    """Prompt tokens per second these nodes prefill together (at least one node's)."""
    return prefill_rate_of(nodes, prefill_tokens_per_s) * max(1, nodes.healthy_nodes)


def kv_pressure_s(nodes: NodeLoad, policy: RoutingPolicy) -> float:
    if nodes.kv_blocks_total == 0:
        return 0.0
    used = 1.0 - nodes.kv_blocks_free / nodes.kv_blocks_total
    threshold = policy.saturation_threshold
    knee = KV_PRESSURE_KNEE * threshold
    return KV_PRESSURE_S * max(0.0, used - knee) / (threshold - knee)


def summary_load(
    summary: RegionSummary,
    policy: RoutingPolicy,
    prefill_tokens_per_s: float,
    model: ModelLoad | None = None,
) -> SummaryLoad:
    """The region's load, on its totals or, given `model`, on that model's nodes."""
    nodes: NodeLoad = summary if model is None else model
    queue_s = queue_delay_s(nodes, prefill_tokens_per_s)
    is_saturated = False
    if nodes.kv_blocks_total > 0:
        used = 1.0 - nodes.kv_blocks_free / nodes.kv_blocks_total
        is_saturated = used > policy.saturation_threshold
    return SummaryLoad(
        is_eligible=(
            summary.state == "active"
            and nodes.healthy_nodes > 0
            and summary.ingress_url is not None
            and summary.weight > 0.0
        ),
        is_saturated=is_saturated,
        queue_s=queue_s,
        load_s=queue_s + kv_pressure_s(nodes, policy),
        url=(summary.ingress_url or "").rstrip("/"),
        prefill_tokens_per_s=prefill_rate_of(nodes, prefill_tokens_per_s),
        prefill_capacity_tokens_per_s=prefill_capacity_of(nodes, prefill_tokens_per_s),
    )


@dataclass(slots=True)
class SummaryLoads:
    """The loads of recent summaries, by summary object and model: gateways that adopt the same
    document (the simulator's PoPs, which share one) work each load out once between them."""

    max_entries: int = MAX_SHARED_LOADS
    # (id(summary), model) -> (summary, policy, prefill rate, load); holding the summary keeps
    # its id. A model's entry is keyed by the summary too: PoPs' summaries of one region differ
    # in their ingress URL while sharing their `ModelLoad`s.
    _entries: dict[
        tuple[int, str | None], tuple[RegionSummary, RoutingPolicy, float, SummaryLoad]
    ] = field(default_factory=dict)

    def load_of(
        self,
        summary: RegionSummary,
        policy: RoutingPolicy,
        prefill_tokens_per_s: float,
        model: ModelLoad | None = None,
    ) -> SummaryLoad:
        key = (id(summary), None if model is None else model.name)
        entry = self._entries.get(key)
        if (
            entry is not None
            and entry[0] is summary
            and entry[1] is policy
            and entry[2] == prefill_tokens_per_s
        ):
            return entry[3]
        load = summary_load(summary, policy, prefill_tokens_per_s, model)
        entries = self._entries
        entries.pop(key, None)
        entries[key] = (summary, policy, prefill_tokens_per_s, load)
        if len(entries) > self.max_entries:
            del entries[next(iter(entries))]  # the oldest
        return load
