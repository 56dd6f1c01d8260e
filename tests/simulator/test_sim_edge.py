"""The edge tier: the gateway's own classifier (gateway/tiers.py) sends light `auto` requests to
the PoP's edge node, and the rest, or everything while the edge is saturated or down, to a
region; its settings change the decisions; the run reports the share the edge answered."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from gateway.tiers import EdgeThresholds
from simulator.__main__ import main
from simulator.calibration import ServiceCalibration
from simulator.compare import world_spec
from simulator.edge import EdgeSpec, auto_requests
from simulator.results import TIER_EDGE, TIER_NONE, TIER_REGION, Outcome, Recorder
from simulator.run import World, WorldOptions, WorldSpec
from simulator.scenarios import SCENARIOS
from simulator.workload import Request, Tenant

NO_PROMPT = Tenant("tenant-x", 0)
LIGHT = (100, 32)  # prompt tokens, output tokens: within the gateway's default thresholds
HEAVY = (2000, 200)


def spec_with(sizes: list[tuple[int, int]], edge: EdgeSpec, gap_s: float = 0.5) -> WorldSpec:
    """Requests of `sizes` from Tokyo (its PoP has an edge), one every `gap_s`."""
    base = world_spec(SCENARIOS["steady"], 0, 5, ServiceCalibration())
    start_s = base.requests[0].arrival_s  # after the fleet has warmed up
    requests = [
        Request(i, start_s + i * gap_s, "tokyo", NO_PROMPT, prompt, output)
        for i, (prompt, output) in enumerate(sizes)
    ]
    return dataclasses.replace(base, requests=requests, options=WorldOptions(edge=edge))


def run(spec: WorldSpec, policy: str = "meridian", edge_up: bool = True) -> Recorder:
    world = World(spec, policy)
    if not edge_up:
        assert world.edge is not None
        world.edge.sites["tokyo"].nodes[0].is_up = False
    recorder = world.run()
    assert np.all(recorder.outcome == Outcome.OK)
    return recorder


EVERY_REQUEST_AUTO = EdgeSpec(auto_share=1.0)


@pytest.mark.parametrize("policy", ["meridian", "oracle"])
def test_a_light_auto_request_is_answered_at_the_edge_and_a_heavy_one_by_a_region(
    policy: str,
) -> None:
    recorder = run(spec_with([LIGHT, HEAVY], EVERY_REQUEST_AUTO), policy)
    assert list(recorder.tier) == [TIER_EDGE, TIER_REGION]
    assert recorder.region[0] == -1 and recorder.region[1] >= 0  # the edge is no region
    assert recorder.num_attempts[0] == 1
    stats = recorder.stats()
    assert stats.edge_share == 0.5


def test_a_saturated_edge_sends_light_requests_to_a_region() -> None:
    spec = spec_with([LIGHT] * 5, dataclasses.replace(EVERY_REQUEST_AUTO, max_concurrency=2), 0.0)
    recorder = run(spec)
    # All five are sent at once (they reach the PoP in the order of their public hops'
    # jitter): the first two there fill the edge, the rest go to a region.
    assert sorted(recorder.tier) == [TIER_REGION] * 3 + [TIER_EDGE] * 2
    assert np.all(recorder.region[recorder.tier == TIER_REGION] >= 0)


def test_a_down_edge_sends_light_requests_to_a_region() -> None:
    recorder = run(spec_with([LIGHT, LIGHT], EVERY_REQUEST_AUTO), edge_up=False)
    assert list(recorder.tier) == [TIER_REGION, TIER_REGION]


def test_the_classifiers_thresholds_change_the_decisions() -> None:
    sizes = [(300, 32), (100, 100)]  # over the default prompt threshold; over max_tokens
    assert list(run(spec_with(sizes, EVERY_REQUEST_AUTO)).tier) == [TIER_REGION] * 2
    wider = dataclasses.replace(EVERY_REQUEST_AUTO, thresholds=EdgeThresholds(512, 128))
    assert list(run(spec_with(sizes, wider)).tier) == [TIER_EDGE] * 2


def test_only_the_auto_share_is_classified_and_nothing_is_without_an_edge() -> None:
    spec = world_spec(SCENARIOS["steady"], 0, 400, ServiceCalibration())
    auto = auto_requests(EdgeSpec(auto_share=0.25), spec.requests, 0)
    assert 60 < len(auto) < 140
    assert auto == auto_requests(EdgeSpec(auto_share=0.25), spec.requests, 0)  # seeded
    assert not auto_requests(EdgeSpec(auto_share=0.0), spec.requests, 0)
    assert np.all(run(spec).tier == TIER_NONE)
    with_edge = run(dataclasses.replace(spec, options=WorldOptions(edge=EdgeSpec(auto_share=0.25))))
    assert set(np.flatnonzero(with_edge.tier != TIER_NONE)) == auto


def test_an_edge_run_reports_the_edge_share_in_the_table_and_the_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "edge.json"
    args = ["run", "--scenario", "steady", "--requests", "200", "--json", str(out), "--jobs", "1"]
    wide = ["--edge-max-prompt-tokens", "1024", "--edge-max-tokens", "256"]  # every request
    assert (
        main([*args, "--policies", "meridian,nearest", "--edge", "--auto-share", "1", *wide]) == 0
    )
    assert "at edge" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["edge"] is True
    meridian, nearest = result["policies"]["meridian"], result["policies"]["nearest"]
    assert 0.0 < meridian["edge_share"] <= 1.0 and meridian["auto_ttft_p99_s"] > 0.0
    assert nearest["edge_share"] == 0.0  # clients go straight to a region: no PoP, no edge
