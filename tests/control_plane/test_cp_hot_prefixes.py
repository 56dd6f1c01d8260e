"""The digest of a region's hot prefixes, per model: keys counted over the model's healthy nodes'
beats, most nodes first then by key, capped; and what a summary costs with a full digest."""

from __future__ import annotations

import time

from test_cp_model_summaries import REGION, add_node

from control_plane.model import Fleet
from control_plane.summaries import hot_digest, summarize_region
from wire.prefix_key import MAX_HOT_PREFIXES
from wire.region_summary import HotPrefix, RegionSummary

A, B, C = "a" * 16, "b" * 16, "c" * 16


def test_keys_are_counted_per_model_over_its_healthy_nodes() -> None:
    fleet = Fleet(unhealthy_after_s=3.0, regions={"us-east": REGION})
    add_node(fleet, "s1", "small", hot_prefixes=(A, B))
    add_node(fleet, "s2", "small", hot_prefixes=(B, C))
    add_node(fleet, "s3", "small", hot_prefixes=(B,))
    add_node(fleet, "s4", "small", drain=True, hot_prefixes=(C,))  # not routable: not counted
    add_node(fleet, "l1", "large", hot_prefixes=(C,))
    summary = summarize_region(REGION, fleet.nodes_in("us-east"))
    by_model = {model.name: model.hot_prefixes for model in summary.models}
    assert by_model == {
        "small": (HotPrefix(key=B, nodes=3), HotPrefix(key=A, nodes=1), HotPrefix(key=C, nodes=1)),
        "large": (HotPrefix(key=C, nodes=1),),
    }
    # What a gateway reads back is the same.
    assert RegionSummary.model_validate_json(summary.model_dump_json()) == summary


def test_the_digest_keeps_the_keys_most_nodes_report() -> None:
    counts = {f"{i:016x}": 1 + i % 3 for i in range(200)}
    digest = hot_digest(counts)
    assert len(digest) == MAX_HOT_PREFIXES
    assert [p.nodes for p in digest[:3]] == [3, 3, 3]
    assert digest[0].key == f"{2:016x}" and digest[-1].nodes == 3  # 66 keys report 3
    assert hot_digest({}) == ()


def test_a_full_digest_costs_little_per_summary() -> None:
    """Measured, not asserted on time: 32 nodes each reporting 64 keys (the bound)."""
    fleet = Fleet(unhealthy_after_s=3.0, regions={"us-east": REGION})
    for n in range(32):
        keys = tuple(sorted(f"{(n * 16 + i) % 256:016x}" for i in range(MAX_HOT_PREFIXES)))
        add_node(fleet, f"n{n}", "small", hot_prefixes=keys)
    nodes = fleet.nodes_in("us-east")
    started = time.perf_counter()
    for _ in range(50):
        summary = summarize_region(REGION, nodes)
    per_summary_us = (time.perf_counter() - started) / 50 * 1e6
    size = len(summary.model_dump_json())
    print(f"summary of 32 nodes x 64 keys: {per_summary_us:.0f} us, {size} bytes")
    assert len(summary.models[0].hot_prefixes) == MAX_HOT_PREFIXES
