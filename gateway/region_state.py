"""What one gateway knows about a region beyond its summary: its breaker, the attempts it has
there, and what its streams taught it (the router's TTFT correction, gateway/routing.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    # The summary's hot prefixes: prefix key -> nodes reporting it, per model, and (under None)
    # the most over its models, for a model-blind plan.
    hot: dict[str | None, dict[str, int]] = field(default_factory=dict)

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
