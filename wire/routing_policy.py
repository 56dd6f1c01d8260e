"""Routing policy: set by operators (`PUT /v1/routing`), followed by gateways.

A gateway scores each candidate region as
`rtt_weight * rtt_ms / 1000 + queue_weight * expected_queue_delay_s` (lower is better), skips
regions whose KV cache is fuller than `saturation_threshold`, and picks between two random
candidates whose cost is within `p2c_tolerance` of the best (power of two choices), so that load
spreads instead of herding onto one region.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class RoutingPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    rtt_weight: float = Field(default=1.0, ge=0.0, le=1000.0, allow_inf_nan=False)
    queue_weight: float = Field(default=1.0, ge=0.0, le=1000.0, allow_inf_nan=False)
    # Relative tolerance: regions costing at most (1 + p2c_tolerance) × best are "near-best".
    # Narrow, because the cost already counts this gateway's own requests awaiting a first byte
    # (a surge spreads by them); 0.2 cost the simulator's calm days 6-7% at p99 (docs/simulator.md).
    p2c_tolerance: float = Field(default=0.05, ge=0.0, le=10.0, allow_inf_nan=False)
    # Prefer the region that served a conversation before (its prefix cache is warm).
    affinity_enabled: bool = True
    # Fraction of KV blocks in use above which a region counts as saturated.
    saturation_threshold: float = Field(default=0.9, gt=0.0, le=1.0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _some_weight(self) -> RoutingPolicy:
        if self.rtt_weight == 0.0 and self.queue_weight == 0.0:
            raise ValueError("rtt_weight and queue_weight cannot both be 0")
        return self
