"""The plan with the regions' hot-prefix digests (wire/prefix_key.py): a near-best region whose
nodes report the request's key is chosen over the rendezvous guess ("cached"), and a region
that reports it but is not near-best is not."""

from __future__ import annotations

from test_gw_routing_models import model_load, region, router

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
