"""The picker's Prometheus metrics, on a small HTTP port of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from region_picker.scoring import Decision


class PickerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.decisions = Counter(
            "meridian_picker_decisions",
            "Requests the picker named a node for",
            ["node"],
            registry=self.registry,
        )
        self.cache_hits = Counter(
            "meridian_picker_cache_hits",
            "Decisions whose chosen node was predicted to hold at least one of the prompt's blocks",
            registry=self.registry,
        )
        self.predicted_cached_tokens = Counter(
            "meridian_picker_predicted_cached_tokens",
            "Prompt tokens predicted cached on the chosen nodes",
            registry=self.registry,
        )
        self.prompt_block_tokens = Counter(
            "meridian_picker_prompt_block_tokens",
            "Prompt tokens in full blocks over all decisions (the most that could be cached)",
            registry=self.registry,
        )
        self.fallbacks = Counter(
            "meridian_picker_fallbacks",
            "Requests the picker named no node for (Envoy balanced them by least request)",
            ["reason"],
            registry=self.registry,
        )
        self.deflections = Counter(
            "meridian_picker_deflections",
            "Requests sent back to their gateway: the best node here was further from a first "
            "token than the next-best region the gateway named",
            registry=self.registry,
        )
        self.decision_seconds = Histogram(
            "meridian_picker_decision_seconds",
            "Time from a request's body in to the picker's answer out",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05),
            registry=self.registry,
        )

    def decided(self, decision: Decision, num_blocks: int) -> None:
        chosen = decision.chosen
        self.decisions.labels(chosen.candidate.node_id).inc()
        if chosen.cached_blocks:
            self.cache_hits.inc()
        self.predicted_cached_tokens.inc(decision.cached_tokens)
        self.prompt_block_tokens.inc(num_blocks * chosen.candidate.block_size)

    def fallback(self, reason: str) -> None:
        self.fallbacks.labels(reason).inc()
