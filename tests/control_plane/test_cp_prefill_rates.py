"""The prefill rate nodes report in their heartbeats, as region summaries carry it (issue 37)."""

from __future__ import annotations

from collections.abc import Mapping

from control_plane.model import Fleet, Node, NodeIdentity, Region
from control_plane.summaries import summarize_region
from wire.heartbeat import Heartbeat


def summary_of(rates: Mapping[str, tuple[str, float | None]]) -> list[float | None]:
    """The region's mean rate, then each model's, for nodes by name → (model, reported rate)."""
    region = Region("us-east", 39.0, -77.5, None, 1.0, "active", 0.0, 0.0)
    fleet = Fleet(unhealthy_after_s=3.0, regions={"us-east": region})
    for name, (model, rate) in rates.items():
        identity = NodeIdentity("us-east", f"http://{name}.test:9001", model, 1)
        node = fleet.nodes[name] = Node(name, identity, False, 0.0)
        beat = Heartbeat(
            node_id=name, region="us-east", url=identity.url, model=model, kv_blocks_total=100,
            kv_blocks_free=100, block_size=16, prefill_tokens_per_s=rate, timestamp=0.0,
        )  # fmt: skip
        fleet.record_beat(node, beat, 0.0, 0.0)
    summary = summarize_region(region, list(fleet.nodes.values()))
    return [
        summary.queue.prefill_tokens_per_s,
        *(m.queue.prefill_tokens_per_s for m in summary.models),
    ]


def test_a_region_carries_the_mean_rate_of_its_nodes_and_of_each_models_nodes() -> None:
    rates = {"n1": ("a", 4000.0), "n2": ("a", 2000.0), "n3": ("b", 12000.0)}
    assert summary_of(rates) == [6000.0, 3000.0, 12000.0]


def test_nodes_that_report_no_rate_are_left_out_of_the_mean_and_none_reporting_gives_none() -> None:
    assert summary_of({"n1": ("a", 3000.0), "n2": ("a", None)}) == [3000.0, 3000.0]
    assert summary_of({"n1": ("a", None), "n2": ("b", None)}) == [None, None, None]
