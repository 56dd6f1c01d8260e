"""The route plan for one model (pure: summaries with per-model loads in, plans out)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from test_gw_routing import CONFIG, summary

from gateway.routing import Router
from gateway.summary_loads import SummaryLoads
from wire.geo import LOCATIONS, locate, rtt_ms
from wire.region_summary import ModelLoad, QueueEstimate, RegionSummary, RegionSummaryIndex
from wire.routing_policy import RoutingPolicy


def model_load(name: str, **fields: Any) -> ModelLoad:
    queue = QueueEstimate(
        num_waiting=0,
        num_waiting_prefill_tokens=fields.pop("waiting_tokens", 0),
        decode_tokens_per_s=1000.0,
        expected_queue_delay_s=fields.pop("queue_s", 0.0),
        prefill_tokens_per_s=fields.pop("rate", None),
    )
    values: dict[str, Any] = {
        "name": name,
        "serving_keys": ("w1:q4_1:fp32",),
        "healthy_nodes": 1,
        "kv_blocks_free": 1000,
        "kv_blocks_total": 1000,
        "queue": queue,
    }
    return ModelLoad(**(values | fields))


def region(name: str, *models: ModelLoad, **fields: Any) -> RegionSummary:
    healthy = sum(m.healthy_nodes for m in models)
    return summary(name, models=models, **({"healthy_nodes": healthy} | fields))


POLICY = RoutingPolicy()


def router(*summaries: RegionSummary, loads: SummaryLoads | None = None) -> Router:
    r = Router(CONFIG, locate("new-york"), rng=random.Random(7), loads=loads or SummaryLoads())
    r.update(RegionSummaryIndex(index=1, regions=list(summaries), routing=POLICY))
    return r


def order(r: Router, model: str | None, prompt_tokens: int = 10) -> list[str]:
    return [c.region for c in r.plan(prompt_tokens, model=model).candidates]


def test_a_model_is_planned_only_among_the_regions_that_serve_it() -> None:
    r = router(
        region("us-east", model_load("small")),
        region("eu-west", model_load("small"), model_load("large")),
        region("ap-northeast", model_load("large")),
    )
    assert order(r, "small") == ["us-east", "eu-west"]
    assert order(r, "large") == ["eu-west", "ap-northeast"]
    assert order(r, "unknown") == []
    assert order(r, None) == ["us-east", "eu-west", "ap-northeast"]  # model-blind: every region


def test_a_region_whose_nodes_for_the_model_are_down_is_not_planned_for_it() -> None:
    r = router(
        region("us-east", model_load("small"), model_load("large", healthy_nodes=0)),
        region("eu-west", model_load("large")),
    )
    assert order(r, "large") == ["eu-west"]
    assert order(r, "small") == ["us-east"]


def test_each_region_is_costed_on_the_models_nodes_not_its_totals() -> None:
    # us-east's totals are idle, but its one node for `large` has 2 s of queue: eu-west wins
    # for `large`; `small`'s idle nodes in us-east keep it first for `small`.
    r = router(
        region("us-east", model_load("small", healthy_nodes=4), model_load("large", queue_s=2.0)),
        region("eu-west", model_load("large")),
    )
    assert order(r, "large") == ["eu-west", "us-east"]
    assert order(r, "small") == ["us-east"]
    assert order(r, None) == ["us-east", "eu-west"]
    # The queue is spread over the model's nodes: 8,000 tokens on 2 nodes at 4,000 tokens/s.
    r = router(region("us-east", model_load("large", waiting_tokens=8000, healthy_nodes=2)))
    candidate = r.plan(400, model="large").candidates[0]
    rtt_s = rtt_ms(locate("new-york"), LOCATIONS["us-east"]) / 1000
    assert candidate.cost_s == pytest.approx(rtt_s + 1.0 + 0.1)


def test_a_models_full_kv_cache_sends_it_last_whatever_the_region_totals() -> None:
    r = router(
        region("us-east", model_load("large", kv_blocks_free=50), kv_blocks_free=900),
        region("eu-west", model_load("large")),
    )
    plan = r.plan(10, model="large")
    assert [c.region for c in plan.candidates] == ["eu-west", "us-east"]
    assert plan.reason == "only"  # us-east is saturated for `large`


def test_region_state_still_rules_a_model_plan() -> None:
    r = router(
        region("us-east", model_load("small"), state="draining"),
        region("eu-west", model_load("small"), weight=0.0),
        region("ap-northeast", model_load("small"), ingress_url=None),
    )
    assert order(r, "small") == []


def test_the_breaker_and_ttft_correction_stay_the_regions() -> None:
    r = router(region("us-east", model_load("small")), region("toronto", model_load("small")))
    east = r.regions["us-east"]
    east.breaker.on_failure(now_s=1e12)
    east.breaker.on_failure(now_s=1e12)
    assert order(r, "small") == ["toronto", "us-east"]
    assert order(r, None) == ["toronto", "us-east"]


def test_model_loads_are_worked_out_once_per_document_and_shared() -> None:
    loads = SummaryLoads()
    regions = [region("us-east", model_load("small")), region("eu-west", model_load("small"))]
    first = router(*regions, loads=loads)
    other_pop = router(*regions, loads=loads)
    first.plan(10, model="small")
    other_pop.plan(10, model="small")
    kept = first.regions["us-east"].model_loads["small"]
    assert other_pop.regions["us-east"].model_loads["small"] is kept
    first.plan(10, model="small")
    assert first.regions["us-east"].model_loads["small"] is kept  # not worked out again
    # A new document: worked out afresh.
    fresh = [region("us-east", model_load("small", queue_s=1.0)), regions[1]]
    first.update(RegionSummaryIndex(index=2, regions=fresh, routing=POLICY))
    assert first.regions["us-east"].model_loads == {}
    assert order(first, "small") == ["eu-west", "us-east"]


def test_a_pops_own_ingress_is_not_shared_through_a_models_load() -> None:
    # Two PoPs' copies of one region differ in their ingress URL but share its ModelLoad.
    loads = SummaryLoads()
    small = model_load("small")
    here = router(region("us-east", small), loads=loads)
    there = router(region("us-east", small, ingress_url="http://elsewhere.test"), loads=loads)
    assert here.plan(10, model="small").candidates[0].url == "http://us-east.test"
    assert there.plan(10, model="small").candidates[0].url == "http://elsewhere.test"


def test_a_model_reporting_no_rate_is_priced_at_the_mean_its_other_regions_report() -> None:
    # `large` runs at 20 tokens/s where measured, `small` at 200: an unmeasured region of
    # `large` is priced at 20 (not at the fleet's mean, nor at the gateway's setting).
    r = router(
        region(
            "us-east", model_load("large", rate=20.0), model_load("small", rate=200.0), rate=110.0
        ),
        region("eu-west", model_load("large")),
    )
    assert r.model_load_of(r.regions["eu-west"], "large").prefill_tokens_per_s == 20.0  # type: ignore[union-attr]
    assert r.load_of(r.regions["eu-west"]).prefill_tokens_per_s == 110.0
