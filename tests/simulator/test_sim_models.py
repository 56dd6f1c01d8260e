"""Models in the simulated fleet: a model placed in two regions beside the default model everywhere,
the summaries and catalog the real control plane publishes for it, and the per-model scenario's
invariants (requests reach only nodes serving their model; with no region serving it, they go to
its fallback, or fail with no capacity)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pytest

from control_plane.dns.config import DnsConfig
from simulator.calibration import ServiceCalibration
from simulator.compare import world_spec
from simulator.flight import AttemptEvent, Flight
from simulator.flow import Traffic
from simulator.models import DEFAULT_MODEL, FP32_IDENTITY
from simulator.node import Job, Node
from simulator.policies import POLICIES
from simulator.results import Outcome, Recorder
from simulator.run import World, WorldSpec
from simulator.scenarios import (
    NODES_PER_REGION,
    PLACED_MODEL,
    PLACED_NODES,
    SCENARIOS,
    workload_of,
)
from simulator.workload import make_requests
from simulator.world import build_geography
from wire.model_catalog import CatalogModel

CAL = ServiceCalibration()
# `oracle_meridian` routes with meridian's own chooser (its world only beats faster): its
# fallbacks are meridian's, and its world costs five of round robin's.
ROUTING_POLICIES = [policy for policy in POLICIES if policy != "oracle_meridian"]
# Enough requests that the 15% of the run with no region serving the placed model outlasts the
# control plane's 3 s to see a region gone.
NUM_REQUESTS = 3000


def test_the_placed_model_has_nodes_of_its_own_in_its_two_regions_only() -> None:
    placement = SCENARIOS["model_fallback"].placement
    assert placement.regions_serving(PLACED_MODEL) == {"us-east", "eu-west"} == set(PLACED_NODES)
    assert placement.regions_serving(DEFAULT_MODEL) == set(NODES_PER_REGION)
    assert placement.nodes["us-east"].count(PLACED_MODEL) == PLACED_NODES["us-east"]
    assert placement.nodes["us-east"].count(DEFAULT_MODEL) == NODES_PER_REGION["us-east"]
    assert placement.num_nodes == sum(NODES_PER_REGION.values()) + sum(PLACED_NODES.values())
    assert placement.catalog.models == (
        CatalogModel(name=DEFAULT_MODEL),
        CatalogModel(name=PLACED_MODEL, fallbacks=(DEFAULT_MODEL,)),
    )
    assert placement.tries_of() == {
        DEFAULT_MODEL: (DEFAULT_MODEL,),
        PLACED_MODEL: (PLACED_MODEL, DEFAULT_MODEL),
    }
    assert SCENARIOS["model_error"].placement.tries_of()[PLACED_MODEL] == (PLACED_MODEL,)
    # One model: every node serves it, and the catalog lists nothing (all served are routable).
    steady = SCENARIOS["steady"].placement
    assert steady.catalog.is_empty and steady.tries_of() == {DEFAULT_MODEL: (DEFAULT_MODEL,)}


def test_requests_ask_for_the_placed_model_by_its_share_on_the_same_arrivals() -> None:
    workload = workload_of(SCENARIOS["model_fallback"], NUM_REQUESTS, CAL)
    shares = build_geography(0).population_shares()
    mixed = make_requests(workload, shares, 0)
    one_model = dataclasses.replace(workload, models=((DEFAULT_MODEL, 1.0),))
    # The model is drawn apart: the arrivals, cities and lengths are those of one model.
    alone = make_requests(one_model, shares, 0)
    assert [dataclasses.replace(r, model=DEFAULT_MODEL) for r in mixed] == alone
    placed = sum(r.model == PLACED_MODEL for r in mixed) / NUM_REQUESTS
    assert 0.08 < placed < 0.12  # its share: 10%


def test_the_summaries_list_each_region_s_models_and_carry_the_catalog() -> None:
    spec = world_spec(SCENARIOS["model_fallback"], 0, NUM_REQUESTS, CAL)
    world = World(spec, "meridian")
    world.control.start()
    world.loop.run(3.0)  # every node has beaten
    document = world.control.current
    assert document.is_model_aware
    assert document.catalog == spec.scenario.placement.catalog
    for summary in document.regions:
        by_model = {model.name: model for model in summary.models}
        expected = {DEFAULT_MODEL: NODES_PER_REGION[summary.name]}
        if summary.name in PLACED_NODES:
            expected[PLACED_MODEL] = PLACED_NODES[summary.name]
        assert {name: m.healthy_nodes for name, m in by_model.items()} == expected
        assert summary.healthy_nodes == sum(expected.values())  # the totals: every node
    us_east = {model.name: model for model in document.regions[-2].models}
    assert document.regions[-2].name == "us-east"
    assert us_east[PLACED_MODEL].serving_keys == (FP32_IDENTITY.serving_key,)
    assert us_east[DEFAULT_MODEL].serving_keys != us_east[PLACED_MODEL].serving_keys


def run_watching_nodes(spec: WorldSpec, policy: str, monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """The run, failing if any attempt goes to a region, or reaches a node, that does not serve
    its model (the policy's plan is per model; the region's ingress routes on it)."""
    at_region, submit = Traffic._at_region, Node.submit

    def checked_region(self: Traffic, event: AttemptEvent) -> None:
        flight = event[0]
        assert flight.site is not None and flight.site.is_serving(flight.model)
        at_region(self, event)

    def checked_node(self: Node, job: Job, now_s: float) -> None:
        assert isinstance(job.owner, Flight)
        assert job.owner.model == self.model, (job.owner.request.request_id, self.name)
        submit(self, job, now_s)

    with monkeypatch.context() as patched:
        patched.setattr(Traffic, "_at_region", checked_region)
        patched.setattr(Node, "submit", checked_node)
        return World(spec, policy).run()


@dataclass(frozen=True)
class PlacedRun:
    """A per-model scenario's run, and its requests for the placed model."""

    spec: WorldSpec
    recorder: Recorder
    placed: int  # the placed model's index in the recorder
    asked: npt.NDArray[np.bool_]  # asked for it
    ok: npt.NDArray[np.bool_]  # answered, by any model
    fraction: npt.NDArray[np.float64]  # arrival, as a fraction of the run (as outages are)
    gone: npt.NDArray[np.bool_]  # asked for it while no region served it

    @classmethod
    def of(cls, scenario: str, policy: str, monkeypatch: pytest.MonkeyPatch) -> PlacedRun:
        spec = world_spec(SCENARIOS[scenario], 1, NUM_REQUESTS, CAL)
        recorder = run_watching_nodes(spec, policy, monkeypatch)
        placed = recorder.models.index(PLACED_MODEL)
        asked = recorder.asked == placed
        first_s, last_s = spec.requests[0].arrival_s, spec.requests[-1].arrival_s
        fraction = (recorder.arrival_s - first_s) / (last_s - first_s)
        # From the failure of the model's last region to the return of its first.
        first, last = spec.scenario.region_failures
        assert last.start < first.end
        gone = asked & (fraction >= last.start) & (fraction < first.end)
        assert gone.sum() > 10
        ok = recorder.outcome == Outcome.OK
        return cls(spec, recorder, placed, asked, ok, fraction, gone)

    def arrived_s(self, fraction: float) -> float:
        """When the run is `fraction` through."""
        first_s, last_s = self.spec.requests[0].arrival_s, self.spec.requests[-1].arrival_s
        return first_s + fraction * (last_s - first_s)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ROUTING_POLICIES)
def test_with_a_fallback_the_model_s_requests_are_answered_by_it_once_no_region_serves_it(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = PlacedRun.of("model_fallback", policy, monkeypatch)
    recorder, placed, asked, ok, gone = run.recorder, run.placed, run.asked, run.ok, run.gone
    default = recorder.models.index(DEFAULT_MODEL)
    by_placed = ok & (recorder.answered == placed)
    regions = {recorder.regions[i] for i in np.unique(recorder.region[by_placed])}
    assert by_placed.any() and regions <= set(PLACED_NODES)
    assert not (~asked & ok & (recorder.answered != default)).any()
    # Sent well before the first failure, each went to the model (a stream may break later: a
    # resume stays on the model, so one still running when its last region dies is cut).
    before = asked & (run.fraction < run.spec.scenario.region_failures[0].start - 0.02)
    assert before.any()
    assert ((recorder.answered == placed) | (recorder.outcome == Outcome.CUT))[before].all()
    if policy == "nearest":  # no gateway, no fallback
        assert not ok[gone].any()
    else:  # the model's only failures: its streams cut when no region was left to resume in
        assert (recorder.outcome[gone] == Outcome.OK).all()
        assert (recorder.answered[gone] == default).all()
        assert (recorder.outcome[asked & ~ok] == Outcome.CUT).all()
    assert recorder.stats().lost == 0


@pytest.mark.slow
@pytest.mark.parametrize("policy", ROUTING_POLICIES)
def test_without_a_fallback_the_model_s_requests_fail_once_no_region_serves_it(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = PlacedRun.of("model_error", policy, monkeypatch)
    recorder, asked, ok, gone = run.recorder, run.asked, run.ok, run.gone
    assert (recorder.answered[asked & ok] == run.placed).all()  # never another model
    assert not ok[gone].any()
    # Once the summaries show the region gone (3 s of missed beats; for geo-DNS, and once the
    # resolvers' answers have expired), no region is planned for the model: the gateway's 503
    # no_capacity (for geo-DNS, no answer), without an attempt.
    known_s = run.arrived_s(run.spec.scenario.region_failures[1].start) + 5.0
    if policy == "nearest":
        known_s += DnsConfig().ttl_s
    seen = gone & (recorder.arrival_s > known_s)
    assert seen.sum() > 3
    assert (recorder.outcome[seen] == Outcome.NO_CAPACITY).all()
    assert (recorder.num_attempts[seen] == 0).all()
    assert recorder.stats().lost == 0
