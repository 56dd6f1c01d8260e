"""The drain sequence's pure core (control_plane/drain/sequence.py): `advance` and its checks on
plain values, with no store, registry or clock: where an advance stops, what effects it returns, and
that a sequence that cannot move comes back unchanged."""

from __future__ import annotations

import dataclasses

from conftest import heartbeat

from control_plane.drain.sequence import (
    AuditEffect,
    ConsulDeregisterEffect,
    DrainFacts,
    DrainSequence,
    DrainTimes,
    advance,
    check_admissions,
    check_in_flight,
    start,
)
from control_plane.model import DONE, ConsulEntry, Node, NodeIdentity
from wire.heartbeat import Heartbeat

T0 = 1_800_000_000.0
TIMES = DrainTimes(
    unhealthy_after_s=3.0,
    dns_ttl_s=5.0,
    envoy_ack_timeout_s=2.0,
    consul_timeout_s=4.0,
    in_flight_timeout_s=30.0,
)
IDENTITY = NodeIdentity(region="us-east", url="http://127.0.0.1:9001", model="m", tp_size=1)


def node(**beat_fields: object) -> Node:
    beat = Heartbeat.model_validate(heartbeat("n1", url=IDENTITY.url, model="m", **beat_fields))
    return Node("n1", IDENTITY, drain_requested=True, registered_at=T0, last_beat=beat, num_beats=1)


def facts(now: float = T0, **fields: object) -> DrainFacts:
    values: dict[str, object] = {
        "now": now,
        "times": TIMES,
        "is_silent": False,
        "lagging_envoys": (),
        "num_envoys": 0,
        "summary_index": 7,
        "has_consul": False,
    }
    return DrainFacts(**(values | fields))  # type: ignore[arg-type]


def at(phase: str, started_at: float = T0) -> DrainSequence:
    sequence, _ = start(node(), "operator", started_at)
    steps = dict(sequence.steps) | {phase: dataclasses.replace(sequence.steps["admissions"])}
    return dataclasses.replace(sequence, phase=phase, steps=steps)


def test_start_enters_admissions_and_records_the_reason() -> None:
    sequence, effect = start(node(), "region", T0)
    assert sequence.phase == "admissions" and sequence.steps["admissions"].started_at == T0
    assert effect == AuditEffect("drain.start", {"reason": "region"})


def test_a_sequence_that_cannot_move_comes_back_unchanged() -> None:
    sequence, _ = start(node(), "operator", T0)
    moved, effects = advance(sequence, node(), facts(T0 + 1.0))
    assert moved is sequence and effects == []


def test_an_advance_stops_where_routing_changes() -> None:
    sequence, _ = start(node(), "operator", T0)
    # The node reports draining, and no Envoy lags: every later check would pass at once, but
    # entering `envoy` takes the node out of EDS, which the caller must push first.
    moved, effects = advance(sequence, node(draining=True), facts(T0 + 0.5))
    assert moved.phase == "envoy"
    assert moved.steps["admissions"].note == "the node reports draining"
    assert effects == [
        AuditEffect(
            "drain.step",
            {"step": "admissions", "note": "the node reports draining", "took_s": 0.5},
        )
    ]
    moved, _ = advance(moved, node(draining=True), facts(T0 + 0.5))
    assert moved.phase == "summaries"  # ... and again where the summaries change
    moved, _ = advance(moved, node(draining=True), facts(T0 + 0.5))
    assert moved.phase == "dns"  # the DNS wait is a wait: no further
    assert moved.steps["summaries"].note == "out of the region summaries (index 7)"


def test_the_rest_of_the_steps_run_in_one_advance_once_their_waits_are_over() -> None:
    moved, effects = advance(at("dns"), node(num_running=0, num_waiting=0), facts(T0 + 5.0))
    assert moved.phase == "exit"
    assert [e.detail["step"] for e in effects if isinstance(e, AuditEffect)] == [
        "dns",
        "consul",
        "in_flight",
    ]
    moved, _ = advance(moved, node(), facts(T0 + 6.0, is_silent=True))
    assert moved.phase == DONE and moved.may_exit


def test_consul_is_asked_once_after_half_the_bound_for_a_node_still_beating() -> None:
    in_consul = dataclasses.replace(node(), consul=ConsulEntry(IDENTITY, "passing"))
    sequence = at("consul")
    moved, effects = advance(sequence, in_consul, facts(T0 + 1.0, has_consul=True))
    assert moved is sequence and effects == []  # its own deregistration may still come
    moved, effects = advance(sequence, in_consul, facts(T0 + 2.0, has_consul=True))
    assert effects == [ConsulDeregisterEffect("n1")] and moved.is_consul_call_made
    again, effects = advance(moved, in_consul, facts(T0 + 3.0, has_consul=True))
    assert again is moved and effects == []  # asked once only
    gone, _ = advance(moved, node(), facts(T0 + 3.5, has_consul=True))
    assert gone.steps["consul"].note == "out of Consul (deregistered by us)"


def test_consul_is_asked_at_once_for_a_silent_node() -> None:
    in_consul = dataclasses.replace(node(), consul=ConsulEntry(IDENTITY, "passing"))
    _, effects = advance(at("consul"), in_consul, facts(T0, has_consul=True, is_silent=True))
    assert effects == [ConsulDeregisterEffect("n1")]


def test_checks_are_plain_functions_of_their_inputs() -> None:
    sequence = at("admissions")
    assert check_admissions(sequence, node(), facts(), 0.0) is None
    assert check_admissions(sequence, node(), facts(), 3.0) == (
        "timed out after 3.0 s: the node does not report draining"
    )
    assert check_admissions(sequence, node(), facts(is_silent=True), 0.0) == (
        "the node is not heartbeating"
    )
    busy = node(num_running=0, num_waiting=0, num_in_flight=2)
    assert check_in_flight(sequence, busy, facts(), 1.0) is None  # the node's own count wins
    assert (
        check_in_flight(sequence, busy, facts(), 30.0) == "timed out after 30.0 s with 2 in flight"
    )
