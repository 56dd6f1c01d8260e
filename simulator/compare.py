"""Every policy on one scenario's traffic: the worlds, their results, and the JSON of a run."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from simulator.calibration import ServiceCalibration
from simulator.results import PolicyStats, Recorder
from simulator.run import World, WorldSpec
from simulator.scenarios import Scenario, workload_of
from simulator.workload import make_requests
from simulator.world import build_geography

# progress(policy, num_ended)
Progress = Callable[[str, int], None]


@dataclass(frozen=True, slots=True)
class ScenarioResult:
    scenario: str
    seed: int
    num_requests: int
    wall_s: float
    stats: dict[str, PolicyStats]
    recorders: dict[str, Recorder]

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "seed": self.seed,
            "requests": self.num_requests,
            "wall_s": round(self.wall_s, 2),
            "policies": {name: stats.to_json() for name, stats in self.stats.items()},
        }


def world_spec(
    scenario: Scenario, seed: int, num_requests: int, calibration: ServiceCalibration
) -> WorldSpec:
    geography = build_geography(seed)
    workload = workload_of(scenario, num_requests, calibration)
    requests = make_requests(workload, geography.population_shares(), seed)
    return WorldSpec(scenario, geography, calibration, requests, seed)


def run_scenario(
    scenario: Scenario,
    seed: int,
    num_requests: int,
    calibration: ServiceCalibration,
    policies: Sequence[str],
    progress: Progress | None = None,
) -> ScenarioResult:
    started_s = time.perf_counter()
    spec = world_spec(scenario, seed, num_requests, calibration)
    recorders: dict[str, Recorder] = {}
    for policy in policies:

        def report(num_ended: int, policy: str = policy) -> None:
            if progress is not None:
                progress(policy, num_ended)

        recorders[policy] = World(spec, policy).run(report)
    stats = {policy: recorder.stats() for policy, recorder in recorders.items()}
    wall_s = time.perf_counter() - started_s
    return ScenarioResult(scenario.name, seed, num_requests, wall_s, stats, recorders)
