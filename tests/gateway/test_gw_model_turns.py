"""The turn of a request's models (pure): a model whose every region is circuit-open or
saturated has no capacity, so its fallbacks go first; failover stays on the first region's
weights. gateway/dispatch.py and simulator/flow.py both take these decisions."""

from __future__ import annotations

from collections.abc import Callable

from test_gw_routing_models import model_load, region, router

from gateway.model_routes import in_turn
from gateway.plan_checks import among_same_weights, has_capacity
from gateway.routing import Candidate, RoutePlan

SAME, OTHER = ("w1:none:fp32",), ("w2:none:fp32",)


def plans(by_model: dict[str, RoutePlan]) -> tuple[Callable[[str], RoutePlan], list[str]]:
    """`plan_of` over `by_model`, and the list of the models it was asked for, in order."""
    asked: list[str] = []

    def plan_of(model: str) -> RoutePlan:
        asked.append(model)
        return by_model[model]

    return plan_of, asked


def plan(*regions: str, reason: str = "p2c") -> RoutePlan:
    return RoutePlan([Candidate(name, "", 0.0, 0.0, 0.0, 0) for name in regions], reason)  # type: ignore[arg-type]


def capacity(model: str, plan: RoutePlan) -> bool:
    return has_capacity(plan)


def test_a_plan_has_capacity_unless_every_region_is_open_or_saturated() -> None:
    r = router(
        region("us-east", model_load("small")),
        region("eu-west", model_load("small"), model_load("large")),
    )
    assert has_capacity(r.plan(10, model="small")) and has_capacity(r.plan(10, model="large"))
    state = r.regions["eu-west"]
    for _ in range(r.config.breaker_failures):
        state.breaker.on_failure(0.0)
    assert not has_capacity(r.plan(10, model="large", now_s=0.0))  # eu-west is its only region
    assert [c.region for c in r.plan(10, model="large", now_s=0.0).candidates] == ["eu-west"]
    assert has_capacity(r.plan(10, model="small", now_s=0.0))  # us-east is not open
    assert not has_capacity(r.plan(10, model="unknown"))  # no region at all
    saturated = router(region("eu-west", model_load("large", kv_blocks_free=10)))
    assert not has_capacity(saturated.plan(10, model="large"))


def test_models_with_capacity_are_planned_and_tried_in_their_turn_only() -> None:
    plan_of, asked = plans({"large": plan("eu-west"), "small": plan("us-east")})
    turns = in_turn(("large", "small"), plan_of, capacity)
    assert next(turns) == ("large", plan("eu-west"))
    assert asked == ["large"]  # the fallback is planned only if the model is refused
    assert list(turns) == [("small", plan("us-east"))]


def test_a_model_without_capacity_goes_after_its_fallbacks_not_never() -> None:
    dead = plan("eu-west", reason="fallback")
    plan_of, asked = plans({"large": dead, "medium": plan(), "small": plan("us-east")})
    turns = list(in_turn(("large", "medium", "small"), plan_of, capacity))
    assert turns == [("small", plan("us-east")), ("large", dead), ("medium", plan())]
    assert asked == ["large", "medium", "small"]  # each planned once


def test_the_caller_may_count_a_plan_as_having_capacity() -> None:
    # The gateway's `auto`: its own model goes to the edge even with no region to plan.
    plan_of, _ = plans({"auto-model": plan(), "small": plan("us-east")})
    turns = in_turn(
        ("auto-model", "small"),
        plan_of,
        lambda model, p: model == "auto-model" or has_capacity(p),
    )
    assert [model for model, _ in turns] == ["auto-model", "small"]


def test_failover_stays_among_the_regions_serving_the_first_regions_weights() -> None:
    r = router(
        region("us-east", model_load("small", serving_keys=SAME)),
        region("toronto", model_load("small", serving_keys=OTHER)),
        region("chicago", model_load("small", serving_keys=SAME)),
        region("eu-west", model_load("small", serving_keys=SAME + OTHER)),  # mixed nodes
    )
    full = r.plan(10, model="small")
    assert full.candidates[0].region == "us-east"
    same = among_same_weights(full, r.regions, "small")
    assert [c.region for c in same.candidates] == ["us-east", "chicago"]
    assert same.reason == full.reason
    # Regions whose nodes report the same mix, or nothing, are alike to each other.
    unsaid = router(
        region("us-east", model_load("small", serving_keys=())),
        region("eu-west", model_load("small", serving_keys=())),
    )
    assert among_same_weights(unsaid.plan(10, model="small"), unsaid.regions, "small") == (
        unsaid.plan(10, model="small")
    )
    lone = plan("us-east")
    assert among_same_weights(lone, r.regions, "small") is lone
