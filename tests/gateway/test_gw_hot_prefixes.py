"""The plan with the regions' hot-prefix digests (wire/prefix_key.py): a near-best region whose
nodes report the request's key is chosen over the rendezvous guess ("cached"), and a region
that reports it but is not near-best is not, unless the system prompt is long enough that its
prefill outweighs the trip (MIN_CACHED_PREFILL_S)."""

from __future__ import annotations

import pytest
from test_gw_routing_models import model_load, region, router

from gateway.routing import MIN_CACHED_PREFILL_S
from wire.region_summary import HotPrefix

KEY = "0123456789abcdef"


def hot(key: str = KEY, nodes: int = 1) -> tuple[HotPrefix, ...]:
    return (HotPrefix(key=key, nodes=nodes),)


def guess(model: str | None = "small") -> str:
    """Where affinity sends KEY with no digest anywhere (us-east and toronto are near-best)."""
    r = router(region("us-east", model_load("small")), region("toronto", model_load("small")))
    plan = r.plan(10, KEY, model=model)
    assert plan.reason == "affinity"
    return plan.candidates[0].region


def test_a_near_best_region_holding_the_key_is_chosen_over_the_guess() -> None:
    guessed = guess()
    other = "toronto" if guessed == "us-east" else "us-east"
    r = router(
        region(guessed, model_load("small")),
        region(other, model_load("small", hot_prefixes=hot())),
    )
    plan = r.plan(10, KEY, model="small")
    assert (plan.candidates[0].region, plan.reason) == (other, "cached")
    # Model-blind (no model named): the digest of any of the region's models counts.
    assert r.plan(10, KEY).candidates[0].region == other
    # Another key, or the key under another model: as before.
    assert r.plan(10, "fedcba9876543210", model="small").reason == "affinity"
    assert r.plan(10, KEY, model="large").candidates == []


def test_the_region_with_more_nodes_holding_it_wins() -> None:
    r = router(
        region("us-east", model_load("small", hot_prefixes=hot(nodes=1))),
        region("toronto", model_load("small", hot_prefixes=hot(nodes=3))),
    )
    assert r.plan(10, KEY, model="small").candidates[0].region == "toronto"


def test_a_far_region_holding_the_key_does_not_outweigh_load_and_latency() -> None:
    r = router(
        region("us-east", model_load("small")),
        region("ap-northeast", model_load("small", hot_prefixes=hot(nodes=5))),
    )
    plan = r.plan(10, KEY, model="small")
    assert [c.region for c in plan.candidates] == ["us-east", "ap-northeast"]
    assert plan.reason == "only"
    busy = router(
        region("us-east", model_load("small")),
        region("toronto", model_load("small", queue_s=2.0, hot_prefixes=hot())),
    )
    assert busy.plan(10, KEY, model="small").candidates[0].region == "us-east"


def test_a_long_cached_system_prompt_draws_the_request_to_a_farther_region() -> None:
    r = router(
        region("us-east", model_load("small")),
        region("ap-northeast", model_load("small", hot_prefixes=hot())),
    )
    rate = r.config.prefill_tokens_per_s
    long_prefix = round(2 * MIN_CACHED_PREFILL_S * rate)  # its prefill: twice the least
    plan = r.plan(long_prefix + 100, KEY, model="small", prefix_tokens=long_prefix)
    assert [c.region for c in plan.candidates] == ["ap-northeast", "us-east"]
    far, near = plan.candidates
    assert far.cost_s < near.cost_s - MIN_CACHED_PREFILL_S / 2
    assert plan.alternative_s == near.cost_s  # priced without a cache: it holds none
    # A next-best region priced on a cache it may not hold is no alternative to offer.
    both = router(
        region("us-east", model_load("small", hot_prefixes=hot())),
        region("ap-northeast", model_load("small", hot_prefixes=hot())),
    )
    plan = both.plan(long_prefix + 100, KEY, model="small", prefix_tokens=long_prefix)
    assert [c.cached_tokens > 0 for c in plan.candidates] == [True, True]
    assert plan.alternative_s is None
    # What the attempt brings the region to prefill, counted as queue there until its first
    # byte (gateway/attempts.py), leaves the cached part out.
    assert (far.cached_tokens, near.cached_tokens) == (long_prefix, 0)
    # What the TTFT is measured against still prefills the whole prompt: the node's reported
    # hits come off it when the stream ends (`observe_ttft`).
    assert far.predicted_ttft_s == pytest.approx(far.rtt_ms / 1000 + (long_prefix + 100) / rate)
    # Nothing comes off where no region lists the key, or when the gateway does not say how
    # long the system prompt is.
    for plan in (
        r.plan(long_prefix + 100, "fedcba9876543210", model="small", prefix_tokens=long_prefix),
        r.plan(long_prefix + 100, KEY, model="small"),
    ):
        assert all(c.cost_s == pytest.approx(c.predicted_ttft_s) for c in plan.candidates)


def test_a_short_cached_system_prompt_is_not_worth_the_trip() -> None:
    r = router(
        region("us-east", model_load("small")),
        region("ap-northeast", model_load("small", hot_prefixes=hot())),
    )
    short_prefix = round(0.9 * MIN_CACHED_PREFILL_S * r.config.prefill_tokens_per_s)
    plan = r.plan(short_prefix + 100, KEY, model="small", prefix_tokens=short_prefix)
    assert [c.region for c in plan.candidates] == ["us-east", "ap-northeast"]
    assert all(c.cached_tokens == 0 for c in plan.candidates)
