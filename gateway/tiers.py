"""Which tier answers a request for the model alias `auto`: the edge node beside the PoP, or a
region. A pure function of the request's size, the key's policy and the edge's availability (no
clock, no I/O), so that the simulator models the edge tier with this very rule.

Light requests (a short prompt and a small `max_tokens`) go to the edge: their time to first
token is mostly the network, and the edge is one hop away. Everything else goes to a region,
whose nodes are bigger and whose batches are fuller. A key's policy may forbid the edge (say, a
tenant whose data must stay in a region) or force it (a tenant that wants the lowest latency
whatever the size); neither sends work to an edge that is saturated or down, or that serves
another model than the one the request resolved to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Tier = Literal["edge", "region"]
EdgePolicy = Literal["auto", "forbid", "force"]
Reason = Literal[
    "light", "heavy", "forced", "forbidden", "saturated", "down", "no_edge", "other_model"
]

AUTO_MODEL = "auto"


@dataclass(frozen=True, slots=True)
class EdgeThresholds:
    max_prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True, slots=True)
class TierChoice:
    tier: Tier
    reason: Reason


def is_light(prompt_tokens: int, max_tokens: int, thresholds: EdgeThresholds) -> bool:
    return prompt_tokens <= thresholds.max_prompt_tokens and max_tokens <= thresholds.max_tokens


def classify(
    prompt_tokens: int,
    max_tokens: int,
    thresholds: EdgeThresholds,
    policy: EdgePolicy = "auto",
    is_edge_up: bool = True,
    is_edge_saturated: bool = False,
    has_edge: bool = True,
    is_edge_model: bool = True,
) -> TierChoice:
    """The tier for an `auto` request of `prompt_tokens` (estimated) and `max_tokens`.
    `has_edge` False: this PoP runs no edge node (the request is light, not refused by one);
    `is_edge_model` False: the edge serves another model than the request's."""
    if policy == "forbid":
        return TierChoice("region", "forbidden")
    if policy != "force" and not is_light(prompt_tokens, max_tokens, thresholds):
        return TierChoice("region", "heavy")
    if not has_edge:
        return TierChoice("region", "no_edge")
    if not is_edge_model:
        return TierChoice("region", "other_model")
    if not is_edge_up:
        return TierChoice("region", "down")
    if is_edge_saturated:
        return TierChoice("region", "saturated")
    return TierChoice("edge", "forced" if policy == "force" else "light")
