"""Every policy on one scenario's traffic: the worlds, their results, and the JSON of a run.

With `jobs` > 1 the policies' worlds run in forked worker processes (each world is independent
and seeded, so the results are the same either way), in groups of about equal cost
(simulator/split.py); the workers inherit the built world spec and report progress through
shared counters.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from simulator.bound import floor_ttfts_s
from simulator.calibration import ServiceCalibration
from simulator.results import PolicyStats, Recorder
from simulator.run import World, WorldOptions, WorldSpec
from simulator.scenarios import Scenario, workload_of
from simulator.split import split_worlds
from simulator.workload import make_requests
from simulator.world import build_geography

# The clairvoyant policies: the best p99 of those run is the bound the others are measured
# against (docs/simulator.md, "The bound").
CLAIRVOYANT = ("oracle", "oracle_spread", "oracle_meridian", "oracle_direct")

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
    has_edge: bool = False
    placed_model: str | None = None  # the model served in a few regions only, if any
    node_picker: bool = True  # each region's picker chose the node (else Envoy's least request)

    @property
    def bound(self) -> tuple[str, float] | None:
        """The clairvoyant policy run with the least p99 TTFT, and that p99 (None: none ran)."""
        run = [(self.stats[p].ttft_p99_s, p) for p in CLAIRVOYANT if p in self.stats]
        if not run:
            return None
        p99_s, policy = min(run)
        return policy, p99_s

    def to_json(self) -> dict[str, Any]:
        bound = self.bound
        return {
            "scenario": self.scenario,
            "seed": self.seed,
            "requests": self.num_requests,
            "wall_s": round(self.wall_s, 2),
            "edge": self.has_edge,
            "node_picker": self.node_picker,
            "policies": {name: stats.to_json() for name, stats in self.stats.items()},
            "bound": None if bound is None else {"policy": bound[0], "ttft_p99_s": bound[1]},
        }


def world_spec(
    scenario: Scenario,
    seed: int,
    num_requests: int,
    calibration: ServiceCalibration,
    options: WorldOptions | None = None,
) -> WorldSpec:
    geography = build_geography(seed)
    workload = workload_of(scenario, num_requests, calibration)
    requests = make_requests(workload, geography.population_shares(), seed)
    return WorldSpec(scenario, geography, calibration, requests, seed, options or WorldOptions())


PROGRESS_POLL_S = 0.2

# A worker process's inheritance (set by `_start_worker` in the forked child only).
_worker_spec: WorldSpec | None = None
_worker_counters: Any = None


def _start_worker(spec: WorldSpec, counters: Any) -> None:
    global _worker_spec, _worker_counters
    _worker_spec, _worker_counters = spec, counters


def _run_in_worker(policies: list[str], slots: list[int]) -> list[Recorder]:
    """One group's worlds, one after the other."""
    assert _worker_spec is not None
    recorders = []
    for policy, slot in zip(policies, slots, strict=True):

        def report(num_ended: int, slot: int = slot) -> None:
            _worker_counters[slot] = num_ended

        recorders.append(World(_worker_spec, policy).run(report))
    return recorders


def _run_serial(
    spec: WorldSpec, policies: Sequence[str], progress: Progress | None
) -> dict[str, Recorder]:
    recorders: dict[str, Recorder] = {}
    for policy in policies:

        def report(num_ended: int, policy: str = policy) -> None:
            if progress is not None:
                progress(policy, num_ended)

        recorders[policy] = World(spec, policy).run(report)
    return recorders


def _run_parallel(
    spec: WorldSpec, policies: Sequence[str], jobs: int, progress: Progress | None
) -> dict[str, Recorder]:
    context = multiprocessing.get_context("fork")
    counters = context.Array("q", len(policies), lock=False)
    groups = split_worlds(policies, jobs)
    with concurrent.futures.ProcessPoolExecutor(
        len(groups), mp_context=context, initializer=_start_worker, initargs=(spec, counters)
    ) as pool:
        futures = {
            pool.submit(_run_in_worker, group, [policies.index(p) for p in group]): group
            for group in groups
        }
        pending = set(futures)
        while pending:
            _, pending = concurrent.futures.wait(pending, timeout=PROGRESS_POLL_S)
            if progress is not None:
                for slot, policy in enumerate(policies):
                    progress(policy, counters[slot])
        done = {
            policy: recorder
            for future, group in futures.items()
            for policy, recorder in zip(group, future.result(), strict=True)
        }
    return {policy: done[policy] for policy in policies}


def run_scenario(
    scenario: Scenario,
    seed: int,
    num_requests: int,
    calibration: ServiceCalibration,
    policies: Sequence[str],
    progress: Progress | None = None,
    jobs: int = 1,
    options: WorldOptions | None = None,
) -> ScenarioResult:
    started_s = time.perf_counter()
    spec = world_spec(scenario, seed, num_requests, calibration, options)
    if jobs > 1 and len(policies) > 1:
        recorders = _run_parallel(spec, policies, min(jobs, len(policies)), progress)
    else:
        recorders = _run_serial(spec, policies, progress)
    floors_s = floor_ttfts_s(spec) if spec.options.edge is None else None
    stats = {policy: recorder.stats(floors_s) for policy, recorder in recorders.items()}
    wall_s = time.perf_counter() - started_s
    has_edge = spec.options.edge is not None
    placed = scenario.placed.name if scenario.placed is not None else None
    return ScenarioResult(
        scenario.name, seed, num_requests, wall_s, stats, recorders, has_edge, placed,
        spec.options.node_picker,
    )  # fmt: skip
