"""Whole runs: the same seed gives the same run, every request ends, and the `meridian` policy's
decisions are the real gateway routing's (its policy settings change them)."""

from __future__ import annotations

import dataclasses
from functools import partial

import numpy as np
import pytest

from gateway.attempts import ConnectTimeout, Try
from gateway.relay import SilenceLimits
from gateway.routing import Candidate, Router
from simulator.calibration import ServiceCalibration
from simulator.compare import world_spec
from simulator.flight import AttemptEvent, Flight
from simulator.flow import Traffic
from simulator.gateway_timing import GatewayTiming
from simulator.node import Job
from simulator.policies import POLICIES, MeridianChooser
from simulator.results import Outcome, Recorder
from simulator.run import World, WorldOptions, WorldSpec
from simulator.scenarios import SCENARIOS
from wire.geo import rtt_ms
from wire.routing_policy import RoutingPolicy

pytestmark = pytest.mark.slow  # whole simulated runs: seconds of CPU each

NUM_REQUESTS = 300


def run(spec: WorldSpec, policy: str = "meridian") -> Recorder:
    return World(spec, policy).run()


def same(a: Recorder, b: Recorder) -> bool:
    return (
        np.array_equal(a.outcome, b.outcome)
        and np.array_equal(a.region, b.region)
        and np.array_equal(a.ttft_s, b.ttft_s, equal_nan=True)
        and np.array_equal(a.e2e_s, b.e2e_s, equal_nan=True)
    )


def test_a_run_is_the_same_for_the_same_seed_and_differs_for_another() -> None:
    cal = ServiceCalibration()
    spec = world_spec(SCENARIOS["region_failure"], 3, NUM_REQUESTS, cal)
    assert same(run(spec), run(world_spec(SCENARIOS["region_failure"], 3, NUM_REQUESTS, cal)))
    assert not same(run(spec), run(world_spec(SCENARIOS["region_failure"], 4, NUM_REQUESTS, cal)))


def test_the_meridian_policy_decides_with_the_gateways_router() -> None:
    spec = world_spec(SCENARIOS["steady"], 0, 50, ServiceCalibration())
    world = World(spec, "meridian")
    assert isinstance(world.chooser, MeridianChooser)
    assert all(type(router) is Router for router in world.chooser.routers.values())
    world.run()
    used = {world.traffic.access.pop_for(request.city, 0.0) for request in spec.requests}
    for pop in used:  # each PoP's router adopted summaries with healthy regions in them
        router = world.chooser.routers[pop]
        assert router.is_loaded
        assert all(state.summary.healthy_nodes > 0 for state in router.regions.values())


def test_changing_the_routing_policy_changes_the_simulated_decisions() -> None:
    spec = world_spec(SCENARIOS["steady"], 0, NUM_REQUESTS, ServiceCalibration())
    default = run(spec)
    blind = WorldOptions(routing_policy=RoutingPolicy(rtt_weight=0.0))
    distance_blind = run(dataclasses.replace(spec, options=blind))
    # Without the RTT term the router spreads work by queue alone: far more leaves home.
    assert not np.array_equal(default.region, distance_blind.region)
    assert np.nanmedian(distance_blind.ttft_s) > np.nanmedian(default.ttft_s)


@pytest.mark.parametrize(
    "policy", ["meridian", "oracle", "oracle_direct", "round_robin", "least_loaded"]
)
def test_streams_a_dying_region_cuts_are_continued_elsewhere_as_the_gateway_does(
    policy: str,
) -> None:
    spec = world_spec(SCENARIOS["region_failure"], 3, NUM_REQUESTS, ServiceCalibration())
    resumed = run(spec, policy)
    no_resumes = WorldOptions(max_resumes=0)  # the gateway before resumes
    ended = run(dataclasses.replace(spec, options=no_resumes), policy)
    cut = np.flatnonzero(ended.outcome == Outcome.CUT)
    assert cut.size > 0 and ended.stats().resumed == 0
    stats = resumed.stats()
    assert stats.resumed == cut.size and stats.failed == 0
    assert (resumed.outcome[cut] == Outcome.OK).all()
    (outage,) = SCENARIOS["region_failure"].region_failures
    dead = resumed.regions.index(outage.name)
    assert (resumed.region[cut] != dead).all()  # each ended where it was continued
    assert (resumed.num_resumes[cut] == 1).all() and stats.resume_p99_s > 0.0
    assert (resumed.ttft_s[cut] < resumed.e2e_s[cut]).all()


def test_a_request_a_dying_node_held_before_its_first_byte_fails_over_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caught: list[bool] = []  # per reset: whether the attempt had its first byte yet
    reset = Traffic.reset

    def spy(self: Traffic, job: Job) -> None:
        assert isinstance(job.owner, Flight)
        caught.append(job.owner.is_streaming)
        reset(self, job)

    monkeypatch.setattr(Traffic, "reset", spy)
    spec = world_spec(SCENARIOS["region_failure"], 3, NUM_REQUESTS, ServiceCalibration())
    recorder = run(spec)
    assert False in caught  # some request waited or was in prefill when the region died
    stats = recorder.stats()
    assert stats.failed == 0 and stats.retried > 0
    # The reset reaches the gateway within a one-way delay: nobody waits out the first-byte
    # timeout (a dark region's connect timeout, 2 s, is the longest wait left).
    assert np.nanmax(recorder.ttft_s) < GatewayTiming().first_byte_timeout_s


def test_a_dark_region_costs_the_connect_timeout_of_its_rtt_not_the_ceiling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dark: dict[tuple[int, int], float] = {}  # attempts sent to a dark region: their timeout
    waits: list[tuple[float, float]] = []  # (waited for the failure, the RTT's timeout)
    at_region, failed = Traffic._at_region, Traffic._failed
    timeout = GatewayTiming().connect_timeout

    def at_region_spy(self: Traffic, event: AttemptEvent) -> None:
        flight = event[0]
        at_region(self, event)
        if flight.site is not None and not flight.site.is_up:
            rtt = rtt_ms(flight.origin, flight.site.location)
            dark[(id(flight), event[1])] = timeout.of(rtt)

    def failed_spy(self: Traffic, event: AttemptEvent, deflected: bool = False) -> None:
        expected_s = dark.pop((id(event[0]), event[1]), None)
        if expected_s is not None:
            waits.append((self.loop.now_s - event[0].sent_s, expected_s))
        failed(self, event, deflected)

    monkeypatch.setattr(Traffic, "_at_region", at_region_spy)
    monkeypatch.setattr(Traffic, "_failed", failed_spy)
    spec = world_spec(SCENARIOS["region_hang"], 3, 2000, ServiceCalibration())
    adaptive = run(spec)
    assert waits and all(waited == pytest.approx(expected) for waited, expected in waits)
    assert all(expected < timeout.max_s for _, expected in waits)
    # A gateway that waits the ceiling for every region serves the hang's requests later.
    ceiling = ConnectTimeout(1.0, timeout.max_s, timeout.max_s)
    fixed = partial(GatewayTiming, connect_timeout=ceiling)
    monkeypatch.setattr("simulator.run.GatewayTiming", fixed)
    assert np.nanpercentile(run(spec).ttft_s, 99.9) > np.nanpercentile(adaptive.ttft_s, 99.9)


@pytest.mark.parametrize("scenario", ["region_hang", "node_hang"])
def test_streams_a_hung_node_holds_resume_once_the_summaries_show_it_unhealthy(
    monkeypatch: pytest.MonkeyPatch, scenario: str
) -> None:
    silenced: list[Flight] = []  # the streams under way when their node hung
    hung_nodes: set[str] = set()
    silence = Traffic.silence

    def spy(self: Traffic, job: Job) -> None:
        assert isinstance(job.owner, Flight) and job.owner.node is not None
        if job.owner.is_streaming:
            silenced.append(job.owner)
            hung_nodes.add(job.owner.node.name)
        silence(self, job)

    monkeypatch.setattr(Traffic, "silence", spy)
    # Enough requests for the hang (30% to 60% of the run) to outlast unhealthy_after_s.
    spec = world_spec(SCENARIOS[scenario], 3, 2000, ServiceCalibration())
    recorder = run(spec)
    assert silenced and recorder.stats().failed == 0
    outage = SCENARIOS[scenario].region_hang or SCENARIOS[scenario].node_hang
    assert outage is not None
    first_s, last_s = spec.requests[0].arrival_s, spec.requests[-1].arrival_s
    restarted_s = first_s + outage.end * (last_s - first_s)

    def continued_s(flight: Flight) -> float:  # the continuation's first byte at the PoP
        return flight.broken_s + flight.longest_resume_s

    assert all(f.num_resumes == 1 and f.is_ended for f in silenced)
    # Heartbeats missed for unhealthy_after_s (3 s), the summary's way to the PoP, then the
    # relay's next look: each continued long before the hung region came back.
    assert min(f.longest_resume_s for f in silenced) > 3.0
    assert all(continued_s(f) < restarted_s for f in silenced)
    # A gateway that waits out the 60 s idle timeout whatever the summaries say holds every
    # one of them until the region's restart resets its connections.
    silenced.clear()
    timing = GatewayTiming()
    patient = partial(GatewayTiming, unhealthy_node_silence_s=timing.stream_idle_timeout_s)
    with monkeypatch.context() as patched:
        patched.setattr("simulator.run.GatewayTiming", patient)
        assert run(spec).stats().failed == 0
    assert silenced and all(continued_s(f) > restarted_s for f in silenced)
    if scenario == "node_hang":
        # One node of five: its region stayed healthy, so only the node's own health (the
        # summaries' unhealthy_nodes) could cut the silence short: a relay that knew only the
        # stream's region held every one until the restart.
        assert hung_nodes == {outage.name}
        silenced.clear()
        limit_of = SilenceLimits.of
        monkeypatch.setattr(SilenceLimits, "of", lambda s, region, _: limit_of(s, region, None))
        assert run(spec).stats().failed == 0
        assert silenced and all(continued_s(f) > restarted_s for f in silenced)


def test_clients_that_go_to_a_region_directly_have_no_gateway_to_resume_for_them() -> None:
    spec = world_spec(SCENARIOS["region_failure"], 3, NUM_REQUESTS, ServiceCalibration())
    stats = run(spec, "nearest").stats()
    assert stats.resumed == 0 and stats.failed > 0


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_request_of_every_policy_ends(scenario: str) -> None:
    spec = world_spec(SCENARIOS[scenario], 1, 200, ServiceCalibration())
    for policy in POLICIES:
        stats = run(spec, policy).stats()
        assert stats.lost == 0, policy


def test_the_router_hears_of_each_stream_s_prefix_cache_hits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    heard: list[int] = []
    observe = Router.observe_ttft

    def spy(self: Router, *args: object, cached_tokens: int = 0, **kwargs: object) -> None:
        heard.append(cached_tokens)
        observe(self, *args, cached_tokens=cached_tokens, **kwargs)  # type: ignore[arg-type, misc]

    monkeypatch.setattr(Router, "observe_ttft", spy)
    spec = world_spec(SCENARIOS["prefix_heavy"], 0, NUM_REQUESTS, ServiceCalibration())
    run(spec)
    assert len(heard) == NUM_REQUESTS  # every stream answered, none failed here
    hits = [n for n in heard if n]
    # Tenants repeat their long system prompts: many streams find theirs cached (fewer in so
    # short a run, while the caches are cold), in whole blocks.
    assert len(hits) > NUM_REQUESTS // 3
    assert all(n % ServiceCalibration().block_size == 0 for n in hits)


def test_the_summaries_list_the_system_prompts_each_region_served() -> None:
    """As the node agents do (node_agent/hot_prefixes.py), a simulated node reports in its beats
    the keys of the system prompts it served; the summaries count them per region, and the
    gateways' routers read them there."""
    spec = world_spec(SCENARIOS["prefix_heavy"], 0, NUM_REQUESTS, ServiceCalibration())
    world = World(spec, "meridian")
    recorder = world.run()
    served: dict[str, set[str]] = {}
    settled: dict[str, set[str]] = {}  # served well before the last beats
    settled_by_s = spec.requests[-1].arrival_s - 10.0
    for request in spec.requests:
        region = recorder.regions[recorder.region[request.request_id]]
        if request.affinity_key is not None:
            served.setdefault(region, set()).add(request.affinity_key)
            if request.arrival_s < settled_by_s:
                settled.setdefault(region, set()).add(request.affinity_key)
    documents = {document.index: document for document in world.control.documents}

    def listed(index: int) -> dict[str, set[str]]:
        regions = documents[index].regions
        return {s.name: {p.key for m in s.models for p in m.hot_prefixes} for s in regions}

    last = listed(world.control.current.index)
    assert settled and all(settled[name] <= last[name] for name in settled)
    assert all(last[name] <= served.get(name, set()) for name in last)
    assert isinstance(world.chooser, MeridianChooser)
    routers = [r for r in world.chooser.routers.values() if r.index]  # those that served
    assert routers
    for router in routers:  # each read the digests of the document it adopted last
        held = {
            name: {key for model in state.models for key in state.hot_prefixes(model)}
            for name, state in router.regions.items()
        }
        assert held == listed(router.index)


def test_the_router_judges_its_breakers_by_the_simulated_clock() -> None:
    spec = world_spec(SCENARIOS["steady"], 0, 50, ServiceCalibration())
    world = World(spec, "meridian")
    world.run()
    chooser = world.chooser
    assert isinstance(chooser, MeridianChooser)
    request = spec.requests[0]
    pop = world.traffic.access.pop_for(request.city, 0.0)
    now_s = world.loop.now_s
    first = chooser.order(pop, request, now_s, limit=7)[0].region
    config = chooser.routers[pop].config
    candidate = Candidate(first, "", 0.0, 0.0, 0.0, request.prompt_tokens)
    attempt = Try(candidate, is_resume=False, is_first=True, is_last=False)
    for _ in range(config.breaker_failures):
        chooser.on_attempt(pop, attempt, now_s)
        chooser.on_failure(pop, attempt, now_s)
    assert chooser.order(pop, request, now_s + 1.0, limit=7)[-1].region == first  # open: last
    later = chooser.order(pop, request, now_s + config.breaker_open_s, limit=7)
    assert later[-1].region != first  # half-open: back in its place


def test_clients_that_find_their_pop_by_dns_are_all_served_the_same_way_per_seed() -> None:
    cal, dns = ServiceCalibration(), WorldOptions(access="dns")
    spec = world_spec(SCENARIOS["pop_withdrawal"], 1, NUM_REQUESTS, cal, dns)
    for policy in POLICIES:
        assert run(spec, policy).stats().lost == 0, policy
    again = world_spec(SCENARIOS["pop_withdrawal"], 1, NUM_REQUESTS, cal, dns)
    assert same(run(spec), run(again))
