"""What one gateway knows about a region beyond its summary: its breaker, the attempts it has
there, and what its streams taught it (the router's TTFT correction, gateway/routing.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from gateway.breaker import CircuitBreaker
from gateway.summary_loads import SummaryLoad
from wire.region_summary import ModelLoad, RegionSummary


@dataclass(slots=True)
class RegionState:
    """What this gateway itself knows about a region, beyond its summary."""

    summary: RegionSummary
    rtt_ms: float
    breaker: CircuitBreaker
    num_in_flight: int = 0  # attempts from this gateway, until their answer or stream ends
    num_awaiting_first_byte: int = 0  # those of them with no first byte yet
    # Their prompts, less what the plan took as cached: a burst its summary shows a beat late.
    awaited_tokens: int = 0
    ttft_residual_s: float = 0.0
    residual_at_s: float = 0.0
    num_ttft_samples: int = 0
    load: SummaryLoad | None = None  # for this summary and policy (None: not worked out yet)
    # The summary's models by name, and the loads of those planned for since it came.
    models: dict[str, ModelLoad] = field(default_factory=dict)
    model_loads: dict[str, SummaryLoad] = field(default_factory=dict)
    # The summary's hot prefixes of each model a plan has asked about: prefix key -> nodes
    # reporting it. Made when first asked, not at every summary: a gateway adopts documents more
    # often than it asks of each region's every model (in the simulator, 72% of its time
    # adopting went to these).
    _hot: dict[str, Mapping[str, int]] = field(default_factory=dict, init=False, repr=False)

    def adopt(self, summary: RegionSummary) -> None:
        """`summary` is the region's latest."""
        self.summary = summary
        self.load = None  # worked out when next planned (a PoP may adopt several first)
        self.models = {model.name: model for model in summary.models}
        self.model_loads = {}
        self._hot = {}

    def hot_prefixes(self, model: str) -> Mapping[str, int]:
        """The summary's hot prefixes of `model`'s nodes: key -> how many nodes list it."""
        hot = self._hot.get(model)
        if hot is None:
            load = self.models.get(model)
            hot = {p.key: p.nodes for p in load.hot_prefixes} if load is not None else _NOT_HOT
            self._hot[model] = hot
        return hot

    def nodes_holding(self, model: str | None, key: str | None) -> int:
        """How many of the region's nodes for `model` (None: the most of any model's) its
        summary lists `key` as a hot prefix of (0 without a key)."""
        if key is None:
            return 0
        if model is not None:
            return self.hot_prefixes(model).get(key, 0)
        return max((self.hot_prefixes(name).get(key, 0) for name in self.models), default=0)

    def on_sent(self, awaited_tokens: int) -> None:
        """An attempt left for the region (`gateway.attempts.Try.awaited_tokens`; its
        breaker is told apart)."""
        self.num_in_flight += 1
        self.num_awaiting_first_byte += 1
        self.awaited_tokens += awaited_tokens

    def on_first_byte(self, awaited_tokens: int) -> None:
        self.num_awaiting_first_byte -= 1
        self.awaited_tokens -= awaited_tokens

    def on_no_first_byte(self, awaited_tokens: int) -> None:
        """The attempt failed or was abandoned before its first byte."""
        self.num_in_flight -= 1
        self.on_first_byte(awaited_tokens)


_NOT_HOT: Mapping[str, int] = MappingProxyType({})  # a model whose summary lists no hot prefix
