"""What a route plan says beyond its order, for the dispatch's turn over a request's models
(gateway/model_routes.py `in_turn`) and the simulator's: whether a model has capacity now, and
the failover that stays on one set of weights."""

from __future__ import annotations

from collections.abc import Mapping

from gateway.region_state import RegionState
from gateway.routing import RoutePlan


def has_capacity(plan: RoutePlan) -> bool:
    """Whether some region of `plan` can take work now: one whose circuit is not open and whose
    KV cache is below the saturation threshold. A model whose plan has none has no capacity: its
    fallbacks go first (gateway/model_routes.py `in_turn`), since a region whose breaker just
    opened is most likely down, and every attempt there would wait out the connect timeout."""
    return bool(plan.candidates) and plan.reason != "fallback"


def among_same_weights(
    plan: RoutePlan, regions: Mapping[str, RegionState], model: str
) -> RoutePlan:
    """`plan` (for `model`) less the regions whose nodes for `model` report other weights than
    the first region's (`ModelLoad.serving_keys`, compared whole): failover before the first
    byte stays on the weights the request was first sent to, as a resume does."""
    if len(plan.candidates) < 2:
        return plan
    keys = [_serving_keys(regions.get(c.region), model) for c in plan.candidates]
    if all(key == keys[0] for key in keys):
        return plan
    same = [c for c, key in zip(plan.candidates, keys, strict=True) if key == keys[0]]
    return RoutePlan(same, plan.reason)


def _serving_keys(state: RegionState | None, model: str) -> tuple[str, ...] | None:
    nodes = None if state is None else state.models.get(model)
    return None if nodes is None else nodes.serving_keys
