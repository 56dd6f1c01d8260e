"""Region scoring and choice (pure: summaries in, plans out) and the circuit breaker."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from gateway.breaker import BreakerState, CircuitBreaker
from gateway.routing import Router, RouterConfig
from gateway.summary_loads import KV_PRESSURE_KNEE, KV_PRESSURE_S, SummaryLoads
from wire.geo import LOCATIONS, locate, rtt_ms
from wire.region_summary import QueueEstimate, RegionSummary, RegionSummaryIndex
from wire.routing_policy import RoutingPolicy

CONFIG = RouterConfig(
    prefill_tokens_per_s=4000.0,
    ttft_ewma_alpha=0.5,
    ttft_correction_half_life_s=30.0,
    near_best_slack_s=0.002,
    breaker_failures=2,
    breaker_open_s=5.0,
)


def summary(name: str, **fields: Any) -> RegionSummary:
    place = LOCATIONS[name]
    queue = QueueEstimate(
        num_waiting=0,
        num_waiting_prefill_tokens=fields.pop("waiting_tokens", 0),
        num_running_prefill_tokens=fields.pop("running_tokens", 0),
        decode_tokens_per_s=1000.0,
        expected_queue_delay_s=fields.pop("queue_s", 0.0),
        prefill_tokens_per_s=fields.pop("rate", None),
    )
    values: dict[str, Any] = {
        "name": name,
        "lat": place.lat,
        "lon": place.lon,
        "state": "active",
        "ingress_url": f"http://{name}.test/",
        "healthy_nodes": 1,
        "kv_blocks_free": 1000,
        "kv_blocks_total": 1000,
        "queue": queue,
        "weight": 1.0,
    }
    return RegionSummary(**(values | fields))


def router(*summaries: RegionSummary, policy: RoutingPolicy | None = None) -> Router:
    r = Router(CONFIG, locate("new-york"), rng=random.Random(7))
    r.update(
        RegionSummaryIndex(index=1, regions=list(summaries), routing=policy or RoutingPolicy())
    )
    return r


def order(r: Router, prompt_tokens: int = 10, key: str | None = None) -> list[str]:
    return [c.region for c in r.plan(prompt_tokens, key).candidates]


def test_cost_is_rtt_plus_queue_plus_prefill() -> None:
    r = router(summary("us-east", queue_s=0.5))
    candidate = r.plan(400).candidates[0]
    expected_s = rtt_ms(locate("new-york"), LOCATIONS["us-east"]) / 1000 + 0.5 + 0.1
    assert candidate.cost_s == pytest.approx(expected_s)
    assert candidate.url == "http://us-east.test"


def test_nearest_idle_region_first_then_the_rest_by_cost() -> None:
    r = router(summary("ap-northeast"), summary("eu-west"), summary("us-east"))
    plan = r.plan(10)
    assert [c.region for c in plan.candidates] == ["us-east", "eu-west", "ap-northeast"]
    assert plan.reason == "only"


def test_each_new_document_and_its_policy_are_costed_afresh() -> None:
    # The summary-derived part of the cost is kept between requests, never between documents.
    r = router(summary("us-east"), summary("eu-west"))
    assert order(r) == ["us-east", "eu-west"]
    loaded = [summary("us-east", queue_s=2.0), summary("eu-west")]
    r.update(RegionSummaryIndex(index=2, regions=loaded, routing=RoutingPolicy()))
    assert order(r) == ["eu-west", "us-east"]
    # A policy that ignores queues (queue_weight 0) puts the nearest region first again.
    policy = RoutingPolicy(queue_weight=0.0)
    r.update(RegionSummaryIndex(index=3, regions=loaded, routing=policy))
    assert order(r) == ["us-east", "eu-west"]


def test_routers_sharing_loads_plan_as_they_would_alone() -> None:
    # Gateways that adopt the same document share each summary's load; the RTT stays their own.
    document = RegionSummaryIndex(
        index=1,
        regions=[summary("us-east", queue_s=0.3), summary("eu-west", kv_blocks_free=200)],
        routing=RoutingPolicy(),
    )
    loads = SummaryLoads()
    for pop in ("new-york", "london"):
        shared = Router(CONFIG, locate(pop), loads=loads)
        alone = Router(CONFIG, locate(pop))
        shared.update(document)
        alone.update(document)
        assert shared.plan(300).candidates == alone.plan(300).candidates
    assert [s.load for s in shared.regions.values()] == [
        loads.load_of(s, document.routing, CONFIG.prefill_tokens_per_s) for s in document.regions
    ]
    # A new policy object is costed afresh, not served from the shared entry.
    policy = RoutingPolicy(queue_weight=0.0)
    fresh = loads.load_of(document.regions[0], policy, CONFIG.prefill_tokens_per_s)
    assert fresh.load_s == pytest.approx(0.3) and fresh is not shared.regions["us-east"].load


def test_shared_loads_keep_only_the_newest_summaries() -> None:
    loads = SummaryLoads(max_entries=2)
    policy = RoutingPolicy()
    first, second, third = (summary("us-east", queue_s=q) for q in (0.1, 0.2, 0.3))
    kept = loads.load_of(first, policy, 4000.0)
    assert loads.load_of(first, policy, 4000.0) is kept
    loads.load_of(second, policy, 4000.0)
    loads.load_of(third, policy, 4000.0)  # evicts the oldest, `first`
    assert loads.load_of(first, policy, 4000.0) is not kept
    assert loads.load_of(first, policy, 4000.0) == kept


def test_queueing_delay_outweighs_distance() -> None:
    r = router(summary("us-east", queue_s=2.0), summary("eu-west"))
    assert order(r) == ["eu-west", "us-east"]


def test_prompt_tokens_still_to_prefill_are_queue_spread_over_the_nodes() -> None:
    # 4,000 waiting + 8,000 admitted-but-not-prefilled tokens at 4,000 tokens/s a node.
    r = router(summary("us-east", waiting_tokens=4000, running_tokens=8000, healthy_nodes=2))
    assert r.queue_delay_s(r.regions["us-east"].summary) == pytest.approx(1.5)
    candidate = r.plan(400).candidates[0]
    rtt_s = rtt_ms(locate("new-york"), LOCATIONS["us-east"]) / 1000
    assert candidate.cost_s == pytest.approx(rtt_s + 1.5 + 0.1)
    # The summary's own estimate (waiting tokens over the decode rate) counts when longer.
    r = router(summary("us-east", waiting_tokens=4000, queue_s=4.0))
    assert r.queue_delay_s(r.regions["us-east"].summary) == 4.0


def test_a_prefill_backlog_without_waiting_requests_moves_traffic_away() -> None:
    # The surge case: every slot busy prefilling, nothing waiting, KV to spare.
    r = router(summary("us-east", running_tokens=20_000, healthy_nodes=5), summary("eu-west"))
    assert order(r) == ["eu-west", "us-east"]


@pytest.mark.parametrize(
    ("blocks_free", "pressure_s"),
    [(1000, 0.0), (370, 0.0), (235, KV_PRESSURE_S / 2), (100, KV_PRESSURE_S)],
)
def test_kv_use_costs_smoothly_from_the_knee_to_the_threshold(
    blocks_free: int, pressure_s: float
) -> None:
    # threshold 0.9, knee 0.63: 63% used costs nothing, 76.5% half, 90% all of KV_PRESSURE_S.
    r = router(summary("us-east", kv_blocks_free=blocks_free))
    assert KV_PRESSURE_KNEE == 0.7
    assert r.kv_pressure_s(r.regions["us-east"].summary) == pytest.approx(pressure_s)


def test_a_fuller_kv_cache_tips_the_choice_between_near_regions() -> None:
    r = router(summary("us-east", kv_blocks_free=120), summary("toronto"))
    assert order(r) == ["toronto", "us-east"] and r.plan(10).reason == "only"


def test_long_prompts_weigh_prefill_equally_everywhere() -> None:
    r = router(summary("us-east"), summary("eu-west"))
    assert order(r, prompt_tokens=100_000) == ["us-east", "eu-west"]


@pytest.mark.parametrize(
    "fields",
    [
        {"state": "draining"},
        {"state": "disabled"},
        {"healthy_nodes": 0},
        {"ingress_url": None},
        {"weight": 0.0},
    ],
)
def test_regions_that_cannot_take_new_work_get_none(fields: dict[str, Any]) -> None:
    r = router(summary("us-east", **fields), summary("eu-west"))
    assert order(r) == ["eu-west"]


def test_no_region_means_an_empty_plan() -> None:
    assert router(summary("us-east", state="draining")).plan(10).candidates == []


def test_saturated_and_open_circuit_regions_go_last() -> None:
    r = router(summary("us-east", kv_blocks_free=50), summary("eu-west"))
    assert order(r) == ["eu-west", "us-east"]
    r = router(summary("us-east"), summary("eu-west"))
    state = r.regions["us-east"]
    state.breaker.on_failure(now_s=1e12)
    state.breaker.on_failure(now_s=1e12)
    assert state.breaker.state is BreakerState.OPEN
    assert order(r) == ["eu-west", "us-east"]
    assert r.plan(10).reason == "only"


def test_the_plan_tells_its_first_region_what_the_next_best_preferred_one_costs() -> None:
    plan = router(summary("ap-northeast"), summary("eu-west"), summary("us-east")).plan(10)
    assert [c.region for c in plan.candidates] == ["us-east", "eu-west", "ap-northeast"]
    assert plan.alternative_s == plan.candidates[1].cost_s
    # A saturated region is no alternative, nor is there one with a single region.
    plan = router(summary("us-east"), summary("eu-west", kv_blocks_free=50)).plan(10)
    assert [c.region for c in plan.candidates] == ["us-east", "eu-west"]
    assert plan.alternative_s is None
    assert router(summary("us-east")).plan(10).alternative_s is None


def test_two_choices_spread_load_over_near_best_regions() -> None:
    r = router(summary("us-east"), summary("toronto"), summary("eu-west"))
    first: Counter[str] = Counter()
    for _ in range(200):
        plan = r.plan(10)
        assert plan.reason == "p2c"
        first[plan.candidates[0].region] += 1
        r.regions[plan.candidates[0].region].num_awaiting_first_byte += 1
    assert set(first) == {"us-east", "toronto"}  # eu-west is far from near-best
    assert abs(first["us-east"] - first["toronto"]) <= 2


def test_two_choices_weigh_requests_awaiting_a_first_byte_per_node_not_long_streams() -> None:
    # us-east holds this gateway's long streams (it is the nearest, it took the most work), but
    # none of them waits for its first byte: it has no queue of ours, so it stays the choice.
    r = router(summary("us-east"), summary("toronto"))
    r.regions["us-east"].num_in_flight = 40
    assert [r.plan(10).candidates[0].region for _ in range(20)] == ["us-east"] * 20
    # Two of ours waiting on us-east's three nodes weigh less than one on toronto's one.
    r = router(summary("us-east", healthy_nodes=3), summary("toronto"))
    r.regions["us-east"].num_awaiting_first_byte = 2
    r.regions["toronto"].num_awaiting_first_byte = 1
    assert r.plan(10).candidates[0].region == "us-east"
    r.regions["us-east"].num_awaiting_first_byte = 4
    assert r.plan(10).candidates[0].region == "toronto"


def test_prompts_awaiting_a_first_byte_are_queue_the_summary_lacks() -> None:
    # A surge, or a failed region's work arriving at once (its requests failing over, its
    # streams resuming), shows in the summaries a beat later; this gateway knows what it sent.
    r = router(summary("us-east", healthy_nodes=2), summary("eu-west"))
    state = r.regions["us-east"]
    state.on_sent(0)  # an attempt whose whole prompt the plan took as cached there
    assert order(r, 400)[0] == "us-east"
    for _ in range(40):  # 16,000 prompt tokens sent, over two nodes at 4,000 tokens/s: 2 s
        state.on_sent(400)
    rtt_s = rtt_ms(locate("new-york"), LOCATIONS["us-east"]) / 1000
    us_east = next(c for c in r.plan(400).candidates if c.region == "us-east")
    assert us_east.cost_s == pytest.approx(rtt_s + 2.0 + 0.1)
    assert us_east.predicted_ttft_s == pytest.approx(rtt_s + 2.0 + 0.1)  # the residual's base
    assert order(r, 400)[0] == "eu-west"
    for _ in range(39):
        state.on_first_byte(400)  # those streams go on, no longer ahead of anyone
    state.on_no_first_byte(400)  # one failed
    state.on_first_byte(0)
    assert (state.awaited_tokens, state.num_awaiting_first_byte) == (0, 0)
    assert state.num_in_flight == 40
    assert order(r, 400)[0] == "us-east"


def test_affinity_sticks_to_one_near_best_region_per_prompt() -> None:
    r = router(summary("us-east"), summary("toronto"), summary("eu-west"))
    chosen = {key: {order(r, key=key)[0] for _ in range(5)} for key in map(str, range(40))}
    assert all(len(regions) == 1 for regions in chosen.values())
    assert set().union(*chosen.values()) == {"us-east", "toronto"}
    off = router(
        summary("us-east"), summary("toronto"), policy=RoutingPolicy(affinity_enabled=False)
    )
    assert off.plan(10, "k").reason == "p2c"


def test_observed_ttft_corrects_the_estimate_and_decays() -> None:
    r = router(summary("us-east"), summary("toronto"))
    east, toronto = r.regions["us-east"], r.regions["toronto"]
    predicted = r.predict(toronto, 10, 0.0).predicted_ttft_s
    r.observe_ttft("toronto", predicted, predicted)  # as expected
    predicted = r.predict(east, 10, 0.0).predicted_ttft_s
    r.observe_ttft("us-east", predicted + 0.2, predicted, now_s=toronto.residual_at_s)
    assert order(r)[0] == "toronto" and r.plan(10).reason == "only"
    now = east.residual_at_s
    assert r.correction_s(east, now + 30.0) == pytest.approx(0.1)  # one half-life
    assert r.correction_s(east, now + 300.0) < 0.001


def test_a_region_not_measured_yet_is_assumed_off_as_the_measured_ones_are() -> None:
    # Every stream from us-east came 100 ms later than predicted (what the prediction leaves
    # out, e.g. the first decode step). Toronto, never measured, is assumed as late: at 0 it
    # would look cheaper than us-east and take its work.
    r = router(summary("us-east"), summary("toronto"))
    east = r.regions["us-east"]
    for _ in range(3):
        predicted = r.predict(east, 10, 1.0).predicted_ttft_s
        r.observe_ttft("us-east", predicted + 0.1, predicted, now_s=1.0)
    assert r.correction_s(r.regions["toronto"], 1.0) == pytest.approx(0.1)
    assert r.correction_s(r.regions["toronto"], 31.0) == pytest.approx(0.05)  # it decays too
    assert [r.plan(10, now_s=1.0).candidates[0].region for _ in range(20)] == ["us-east"] * 20


def test_prefix_cache_hits_do_not_make_a_region_look_cheap() -> None:
    # A stream whose 2,000 prompt tokens were all cached came back as fast as its network
    # path: it beat the prediction by the prefill it skipped. That is where the prompt was
    # cached, not something the region's other prompts gain, so the correction stays 0.
    r = router(summary("us-east"), summary("toronto"))
    east = r.regions["us-east"]
    prefill_s = 2000 / r.config.prefill_tokens_per_s
    predicted = r.predict(east, 2000, 1.0).predicted_ttft_s
    r.observe_ttft("us-east", predicted - prefill_s, predicted, cached_tokens=2000, now_s=1.0)
    assert r.correction_s(east, 1.0) == pytest.approx(0.0)
    assert r.correction_s(r.regions["toronto"], 1.0) == pytest.approx(0.0)
    # The same stream with its hits unreported reads as a region faster than predicted.
    unaware = router(summary("us-east"), summary("toronto"))
    unaware.observe_ttft("us-east", predicted - prefill_s, predicted, now_s=1.0)
    assert unaware.correction_s(unaware.regions["us-east"], 1.0) == pytest.approx(-prefill_s)


def test_updates_keep_what_was_learnt_about_a_region() -> None:
    r = router(summary("us-east"))
    r.regions["us-east"].num_in_flight = 3
    r.update(
        RegionSummaryIndex(
            index=2, regions=[summary("us-east", queue_s=1.0)], routing=RoutingPolicy()
        )
    )
    assert r.regions["us-east"].num_in_flight == 3 and r.index == 2
    r.update(RegionSummaryIndex(index=3, regions=[], routing=RoutingPolicy()))
    assert r.regions == {}


def test_breaker_opens_after_failures_then_lets_one_probe_through() -> None:
    breaker = CircuitBreaker("r", max_failures=3, open_s=5.0)
    for _ in range(2):
        breaker.on_failure(0.0)
    assert breaker.is_available(0.0)
    breaker.on_failure(1.0)
    assert breaker.state is BreakerState.OPEN and not breaker.is_available(5.9)
    assert breaker.is_available(6.0)
    breaker.on_attempt(6.0)
    assert breaker.state is BreakerState.HALF_OPEN and not breaker.is_available(6.0)
    breaker.on_failure(6.5)  # the probe failed: open again
    assert breaker.state is BreakerState.OPEN and not breaker.is_available(11.0)
    breaker.on_attempt(11.5)
    breaker.on_success()
    assert breaker.state is BreakerState.CLOSED and breaker.num_failures == 0


# The prefill rate a region's nodes report (issue 37): unlike node types, not one constant.


def test_own_prefill_and_backlog_at_the_reported_rate() -> None:
    r = router(summary("us-east", rate=16000.0, waiting_tokens=8000, healthy_nodes=2))
    candidate = r.plan(1600).candidates[0]
    # 8,000 tokens ahead over 2 nodes at 16,000 tokens/s, then 1,600 of its own at 16,000/s.
    rtt_s = rtt_ms(locate("new-york"), LOCATIONS["us-east"]) / 1000
    assert candidate.predicted_ttft_s == pytest.approx(rtt_s + 0.25 + 0.1)
    unrated = router(summary("us-east", waiting_tokens=8000, healthy_nodes=2))
    # Without a reported rate, the gateway's own (4,000 tokens/s).
    assert unrated.plan(1600).candidates[0].predicted_ttft_s == pytest.approx(rtt_s + 1.0 + 0.4)


def test_a_long_prompt_goes_to_the_farther_region_of_faster_nodes() -> None:
    # us-east is ~8 ms from New York with slow nodes, eu-west ~75 ms with fast ones: 4,000
    # prompt tokens take 2 s at 2,000 tokens/s and 0.2 s at 20,000.
    r = router(summary("us-east", rate=2000.0), summary("eu-west", rate=20000.0))
    assert order(r, prompt_tokens=4000) == ["eu-west", "us-east"]
    assert order(r, prompt_tokens=10) == ["us-east", "eu-west"]


def test_a_region_reporting_no_rate_is_priced_at_the_mean_of_those_that_do() -> None:
    # Nodes measure their rate once they have prefilled: a region not served yet must not look
    # faster than the measured ones for that alone (at the 4,000 setting it would, here by 100x).
    r = router(
        summary("us-east", rate=30.0),
        summary("eu-west", rate=50.0),
        summary("ap-northeast", waiting_tokens=400),
    )
    assert r.load_of(r.regions["ap-northeast"]).prefill_tokens_per_s == pytest.approx(40.0)
    assert r.queue_delay_s(r.regions["ap-northeast"].summary) == pytest.approx(10.0)
    # 400 tokens: 8 s at eu-west, 13.3 s at us-east, 10 s of backlog and 10 s at ap-northeast.
    assert order(r, prompt_tokens=400) == ["eu-west", "us-east", "ap-northeast"]
