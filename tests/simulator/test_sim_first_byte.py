"""The gateway's first-byte timeouts on the simulated clock (simulator/first_byte.py)."""

from __future__ import annotations

from gateway.attempts import AttemptLimits, AttemptSequence, Try
from gateway.routing import Candidate
from simulator.events import EventLoop
from simulator.first_byte import FirstByteTimers
from simulator.flight import AttemptEvent, Flight
from simulator.gateway_timing import GatewayTiming
from simulator.policies import Pick
from simulator.workload import Request, Tenant
from wire.geo import locate
from wire.region_summary import RegionSummary

TIMING = GatewayTiming()
DEADLINE_S = 100.0


def sent(request_id: int, plan: list[str], num_tries: int, is_last_resort: bool) -> AttemptEvent:
    """A flight whose `num_tries`-th attempt over `plan` is under way (those before it failed)."""
    request = Request(request_id, 0.0, "paris", Tenant("t", 0), 100, 10)
    flight = Flight(request, locate("london"), "london", 0.0, (request.model,))
    candidates = [Candidate(r, "", 0.0, 0.0, 0.0, 100) for r in plan]
    flight.attempts = AttemptSequence(candidates, AttemptLimits(3, 0), DEADLINE_S, is_last_resort)
    for _ in range(num_tries):
        step = flight.attempts.next(0.0)
        assert isinstance(step, Try)
        flight.attempt += 1
        flight.step, flight.pick = step, Pick(step.candidate.region)
    return flight, flight.attempt


def test_the_last_place_to_ask_is_waited_on_until_its_region_shows_no_healthy_node() -> None:
    loop = EventLoop()
    healthy_nodes = {"eu-west": 2, "us-east": 2}

    def summary_of(pop: str, region: str) -> RegionSummary:
        return RegionSummary.model_construct(name=region, healthy_nodes=healthy_nodes[region])

    timed_out: list[AttemptEvent] = []
    timers = FirstByteTimers(loop, TIMING, summary_of, timed_out.append)
    failover = sent(1, ["eu-west", "us-east"], 1, is_last_resort=True)  # a region after it
    fallback = sent(2, ["us-east", "eu-west"], 2, is_last_resort=False)  # a model after it
    last = sent(3, ["us-east", "eu-west"], 2, is_last_resort=True)
    for event in (failover, fallback, last):
        timers.arm(event, 0.0)
    loop.run(TIMING.first_byte_timeout_s)
    assert timed_out == [failover, fallback]  # each has somewhere left to go
    loop.run(DEADLINE_S / 2)
    assert timed_out == [failover, fallback]  # its region shows healthy nodes: still waited on
    healthy_nodes["eu-west"] = 0  # its nodes stopped beating
    loop.run(DEADLINE_S / 2 + TIMING.unhealthy_node_silence_s)
    assert timed_out == [failover, fallback, last]


def test_the_last_place_to_ask_is_given_up_on_at_the_request_s_deadline() -> None:
    loop = EventLoop()
    timed_out: list[AttemptEvent] = []

    def always_healthy(pop: str, region: str) -> RegionSummary:
        return RegionSummary.model_construct(name=region, healthy_nodes=1)

    timers = FirstByteTimers(loop, TIMING, always_healthy, timed_out.append)
    last = sent(1, ["us-east"], 1, is_last_resort=True)
    timers.arm(last, 0.0)
    loop.run(DEADLINE_S - 1.0)
    assert timed_out == []
    loop.run(DEADLINE_S + TIMING.unhealthy_node_silence_s)
    assert timed_out == [last] and loop.now_s >= DEADLINE_S


def test_without_a_pop_the_first_byte_timeout_is_the_client_s_own() -> None:
    loop = EventLoop()
    timed_out: list[AttemptEvent] = []
    timers = FirstByteTimers(loop, TIMING, lambda pop, region: None, timed_out.append)
    last = sent(1, ["us-east"], 1, is_last_resort=True)
    timers.arm(last, 0.0)
    loop.run(TIMING.first_byte_timeout_s)
    assert timed_out == [last]
