"""One scenario under one policy: build the world, play the requests, return what happened.

Each policy gets a fresh world built from the same seed (same paths, same fleet, same requests
at the same times from the same cities), so the policies differ only in their decisions.
"""

from __future__ import annotations

import contextlib
import gc
import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from control_plane.model import Region
from simulator.access import Access
from simulator.calibration import ServiceCalibration
from simulator.control import ControlTiming, PopWatch, SimControlPlane
from simulator.edge import EdgeSpec, EdgeTier, auto_requests, edge_site_name
from simulator.events import EventLoop
from simulator.flow import Traffic
from simulator.gateway_timing import DEFAULT_MAX_RESUMES, GatewayTiming
from simulator.node import Job, Node
from simulator.node_picker import NodePicker
from simulator.oracle import ORACLE_SPREAD, DirectOracleChooser, OracleChooser
from simulator.policies import (
    Chooser,
    LeastLoadedChooser,
    MeridianChooser,
    NearestChooser,
    RoundRobinChooser,
    default_router_config,
)
from simulator.results import Recorder
from simulator.scenarios import Outage, Scenario
from simulator.site import Site
from simulator.workload import Request
from simulator.world import Geography
from wire.deflection import DEFAULT_DEFLECT_AT_WAITING
from wire.routing_policy import RoutingPolicy

# How often the progress callback hears how many requests have ended (simulated seconds).
PROGRESS_SLICES = 200
HORIZON_SLACK_S = 60.0
# The garbage collector's young-generation threshold while a world runs (Python's default: 700).
# A world allocates millions of short-lived objects and keeps hundreds of thousands (its
# requests, every summary document published), so at the default the collector scans the old
# generations over and over (a 100,000-request round_robin world: 1.9 of 12.2 CPU seconds with
# flights freed by reference counting, 7.2 of 23.7 before; 0.4 s at this threshold).
GC_YOUNG_THRESHOLD = 100_000


@contextlib.contextmanager
def _rare_collections() -> Iterator[None]:
    thresholds = gc.get_threshold()
    # What exists before the run (the spec, the world) is not garbage: frozen, never scanned.
    # Unless the process froze objects of its own (the test suite does): unfreezing ours would
    # thaw them too, and every later full collection would walk them again (in the suite,
    # 170 ms a collection: 34 of the simulator tests' 62 s).
    owns_freeze = gc.get_freeze_count() == 0
    if owns_freeze:
        gc.collect()  # an earlier world's garbage, lest it be frozen with the rest
        gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        if owns_freeze:
            gc.unfreeze()


@dataclass(frozen=True, slots=True)
class WorldOptions:
    """The settings a run varies besides its scenario (each default: as deployed)."""

    routing_policy: RoutingPolicy = field(default_factory=RoutingPolicy)
    access: Access = "anycast"  # how clients find their PoP
    edge: EdgeSpec | None = None  # the edge tier (None: none)
    deflect_at_waiting: int = DEFAULT_DEFLECT_AT_WAITING  # the node agents' (0: never)
    max_resumes: int = DEFAULT_MAX_RESUMES  # the gateways' (0: a broken stream ends)
    node_picker: bool = True  # each region's picker names the node (False: Envoy's least request)


@dataclass(frozen=True, slots=True)
class WorldSpec:
    """What every policy's world shares."""

    scenario: Scenario
    geography: Geography
    calibration: ServiceCalibration
    requests: Sequence[Request]
    seed: int
    options: WorldOptions = field(default_factory=WorldOptions)


def _ingress_url(index: int) -> str:
    # An IP literal, so the DNS steering can answer with it (198.19.0.0/16: benchmarking range).
    return f"http://198.19.0.{index + 1}:8000"


# The control plane `oracle_meridian` sees: beats every 50 ms, a node unhealthy after three
# missed, swept as often.
FRESH_CONTROL = ControlTiming(
    heartbeat_interval_s=0.05, unhealthy_after_s=0.15, sweep_interval_s=0.05
)


def _chooser(
    policy: str,
    spec: WorldSpec,
    control: SimControlPlane,
    watches: dict[str, PopWatch],
    sites: dict[str, Site],
) -> Chooser:
    geography = spec.geography
    if policy in ("meridian", "oracle_meridian"):
        is_fresh = policy == "oracle_meridian"
        config = default_router_config()
        return MeridianChooser(watches, geography, config, spec.seed, not is_fresh)
    if policy == "round_robin":
        return RoundRobinChooser(watches)
    if policy == "nearest":
        return NearestChooser(lambda: control.current, geography.cities)
    if policy == "least_loaded":
        return LeastLoadedChooser(watches)
    if policy == "oracle":
        return OracleChooser(sites, geography)
    if policy == "oracle_spread":
        return OracleChooser(sites, geography, ORACLE_SPREAD)
    if policy == "oracle_direct":
        return DirectOracleChooser(sites, geography)
    raise ValueError(f"unknown policy {policy!r}")


class World:
    def __init__(self, spec: WorldSpec, policy: str) -> None:
        self.spec = spec
        self.loop = EventLoop()
        geography = spec.geography
        regions = {
            name: Region(name, place.lat, place.lon, _ingress_url(i), 1.0, "active", 0.0, 0.0)
            for i, (name, place) in enumerate(sorted(geography.regions.items()))
        }
        timing = ControlTiming(extra_beat_delay_s=spec.scenario.extra_beat_delay_s)
        # `oracle_meridian` routes on the true state: its nodes beat 20 times a second, straight
        # to the control plane, and the PoPs hold each summary as it is made.
        is_fresh = policy == "oracle_meridian"
        if is_fresh:
            timing = FRESH_CONTROL
        options = spec.options
        routing = options.routing_policy
        placement = spec.scenario.placement
        self.tries_of = placement.tries_of()
        self.control = SimControlPlane(
            self.loop, timing, regions, routing, spec.seed, placement.catalog
        )
        cp = geography.control_plane
        watches = {
            pop: PopWatch(self.control, delay_s, poll_at_cp_s=delay_s)
            for pop, place in geography.pops.items()
            for delay_s in [0.0 if is_fresh else geography.true_rtt_ms(place, cp) / 2000.0]
        }
        self.sites: dict[str, Site] = {}
        self.chooser = _chooser(policy, spec, self.control, watches, self.sites)
        self.recorder = Recorder(len(spec.requests), sorted(regions), list(placement.models))
        self.edge = self._edge_tier() if options.edge is not None else None
        self.traffic = Traffic(
            self.loop,
            geography,
            self.sites,
            self.chooser,
            self.recorder,
            GatewayTiming(max_resumes=options.max_resumes),
            watches,
            options.access,
            self.edge,
        )
        calibrations = spec.scenario.calibrations(spec.calibration)  # by node class
        picks = options.node_picker
        for name, region in regions.items():
            place = geography.regions[name]
            nodes = [
                Node(
                    f"{name}-{i}",
                    name,
                    calibration,
                    self.loop,
                    self.traffic.on_first_token,
                    self.traffic.on_finished,
                    model,
                )
                for i, (model, calibration) in enumerate(
                    zip(placement.nodes[name], calibrations[name], strict=True)
                )
            ]
            assert region.ingress_url is not None
            deflect_at = options.deflect_at_waiting
            picker = NodePicker(nodes, random.Random(f"{spec.seed}/{name}")) if picks else None
            self.sites[name] = Site(
                name, place, region.ingress_url, nodes, deflect_at_waiting=deflect_at,
                picker=picker,
            )  # fmt: skip
            delay_s = 0.0 if is_fresh else geography.true_rtt_ms(place, cp) / 2000.0
            for node in nodes:
                self.control.add_node(node, f"http://{node.name}.{name}.sim:9001", delay_s)

    def _edge_tier(self) -> EdgeTier:
        """An edge site of one node at each PoP that has one (outside the regions' fleet: no
        heartbeats, no summaries; only its own gateway sends it work)."""
        spec = self.spec.options.edge
        assert spec is not None
        pops = self.spec.geography.pops
        sites = {}
        for pop in spec.pops if spec.pops is not None else sorted(pops):
            name = edge_site_name(pop)
            place = replace(pops[pop], name=name)
            node = Node(
                f"{name}-0", name, spec.calibration, self.loop, self._on_first_token,
                self._on_finished,
            )  # fmt: skip
            sites[pop] = Site(name, place, "", [node], deflect_at_waiting=0)  # no Envoy before it
        return EdgeTier(spec, sites, auto_requests(spec, self.spec.requests, self.spec.seed))

    def _on_first_token(self, job: Job) -> None:
        self.traffic.on_first_token(job)

    def _on_finished(self, job: Job) -> None:
        self.traffic.on_finished(job)

    def _schedule_outages(self) -> None:
        requests = self.spec.requests
        first_s, last_s = requests[0].arrival_s, requests[-1].arrival_s

        def at(fraction: float) -> float:
            return first_s + fraction * (last_s - first_s)

        scenario = self.spec.scenario
        outage: Outage
        for outage in scenario.region_failures:
            self.loop.at(at(outage.start), self._fail_region, outage.name)
            self.loop.at(at(outage.end), self._restore_region, outage.name)
        if scenario.region_hang is not None:
            outage = scenario.region_hang
            self.loop.at(at(outage.start), self._hang_region, outage.name)
            self.loop.at(at(outage.end), self._restore_region, outage.name)
        if scenario.node_hang is not None:
            outage = scenario.node_hang
            self.loop.at(at(outage.start), self._hang_node, outage.name)
            self.loop.at(at(outage.end), self._restore_node, outage.name)
        if scenario.pop_withdrawal is not None:
            outage = scenario.pop_withdrawal
            self.loop.at(at(outage.start), self.traffic.withdraw, outage.name)
            self.loop.at(at(outage.end), self.traffic.announce, outage.name)

    def _fail_region(self, name: str) -> None:
        site = self.sites[name]
        site.is_up = False
        for node in site.nodes:
            for job in node.fail(self.loop.now_s):
                self.traffic.reset(job)

    def _hang_region(self, name: str) -> None:
        """Its nodes stop (as if SIGSTOPped, or cut off by a partition): new connections time
        out, open ones go silent, heartbeats stop. It comes back restarted."""
        site = self.sites[name]
        site.is_up = False
        for node in site.nodes:
            self._hang(node)

    def _hang_node(self, name: str) -> None:
        """One node stops as a hung region's do; its region's ingress sends new work to the
        others (the simulated Envoy routes to live nodes only)."""
        self._hang(self._node(name))

    def _hang(self, node: Node) -> None:
        for job in node.fail(self.loop.now_s):
            self.traffic.silence(job)

    def _restore_region(self, name: str) -> None:
        site = self.sites[name]
        site.is_up = True
        for node in site.nodes:
            node.restart(self.loop.now_s)
        self.traffic.restarted(name, {node.name for node in site.nodes})

    def _restore_node(self, name: str) -> None:
        node = self._node(name)
        node.restart(self.loop.now_s)
        self.traffic.restarted(node.region, {name})

    def _node(self, name: str) -> Node:
        return next(n for site in self.sites.values() for n in site.nodes if n.name == name)

    def _arrive(self, index: int) -> None:
        requests = self.spec.requests
        request = requests[index]
        self.traffic.send(request, self.tries_of[request.model])
        if index + 1 < len(requests):
            self.loop.at(requests[index + 1].arrival_s, self._arrive, index + 1)

    def run(self, progress: Callable[[int], None] | None = None) -> Recorder:
        """Play every request to its end; `progress(num_ended)` now and then."""
        with _rare_collections():
            return self._run(progress)

    def _run(self, progress: Callable[[int], None] | None) -> Recorder:
        requests = self.spec.requests
        # Without routing on summaries, only a gateway's stream silences read them.
        scenario = self.spec.scenario
        is_hang = scenario.region_hang is not None or scenario.node_hang is not None
        if self.chooser.needs_control_plane or is_hang:
            self.control.start()
        self._schedule_outages()
        self.loop.at(requests[0].arrival_s, self._arrive, 0)
        slice_s = max(1.0, requests[-1].arrival_s / PROGRESS_SLICES)
        # No request can outlive its deadline: past this, what has not ended is lost.
        horizon_s = requests[-1].arrival_s + GatewayTiming().request_deadline_s + HORIZON_SLACK_S
        until_s = 0.0
        while self.loop.num_pending:
            until_s += slice_s
            if self.recorder.num_ended == len(requests) or until_s > horizon_s:
                self.control.stop()  # only timers and wasted work are left
                until_s = math.inf
            self.loop.run(until_s)
            if progress is not None:
                progress(self.recorder.num_ended)
        return self.recorder
