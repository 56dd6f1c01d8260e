"""Unlike nodes (issue 37): node classes per region, the prefill rate each node beats, the
summaries' mean of it, and the GPU-class calibration from published figures."""

from __future__ import annotations

import pytest

from simulator.calibration import ServiceCalibration
from simulator.compare import world_spec
from simulator.hardware import GPU_CLASS_CALIBRATION, NODE_CLASSES
from simulator.run import World
from simulator.scenarios import MIXED_NODE_CLASSES, SCENARIOS, workload_of

BASE = ServiceCalibration()


def test_each_node_takes_its_class_calibration_in_the_mixed_scenario_only() -> None:
    mixed = SCENARIOS["mixed_hardware"].calibrations(BASE)
    l40s = NODE_CLASSES["l40s"].of(BASE)
    assert l40s.prefill_tokens_per_s < BASE.prefill_tokens_per_s
    assert l40s.step_base_s > BASE.step_base_s and l40s.kv_blocks < BASE.kv_blocks
    assert mixed["us-west"] == [l40s] * 4
    for region, classes in MIXED_NODE_CLASSES.items():
        assert [c.prefill_tokens_per_s for c in mixed[region]] == [
            NODE_CLASSES[name].of(BASE).prefill_tokens_per_s
            for name, count in classes
            for _ in range(count)
        ]
    assert all(
        nodes == [BASE] * len(nodes) for nodes in SCENARIOS["steady"].calibrations(BASE).values()
    )


def test_the_load_follows_the_fleets_capacity() -> None:
    steady = workload_of(SCENARIOS["steady"], 1000, BASE)
    mixed = workload_of(SCENARIOS["mixed_hardware"], 1000, BASE)
    assert mixed.rate_req_s < 0.8 * steady.rate_req_s  # slower classes serve less
    assert workload_of(SCENARIOS["steady"], 1000, GPU_CLASS_CALIBRATION).rate_req_s > 5 * (
        steady.rate_req_s
    )


@pytest.mark.slow
def test_summaries_carry_the_mean_prefill_rate_the_nodes_beat() -> None:
    spec = world_spec(SCENARIOS["mixed_hardware"], 0, 50, BASE)
    world = World(spec, "meridian")
    world.run()
    calibrations = SCENARIOS["mixed_hardware"].calibrations(BASE)
    document = world.control.current
    for summary in document.regions:
        rates = [c.prefill_tokens_per_s for c in calibrations[summary.name]]
        assert summary.queue.prefill_tokens_per_s == pytest.approx(sum(rates) / len(rates), abs=0.1)
