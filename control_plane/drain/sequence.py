"""One drain sequence per node: the ordered steps that take a node out of service safely.

Whatever starts a drain — an operator (`POST /v1/nodes/{id}/drain`), the node's region (`PATCH`
to `state: draining`, or `DELETE`, as `terraform destroy` calls it), or the node itself (a node
agent that got SIGTERM reports `draining`) — the node goes through the same steps, in order:

1. admissions: the heartbeat reply says `drain: true`; done when the node reports `draining` (or
   is silent, or after `unhealthy_after_s`).
2. envoy: out of EDS; done when every connected Envoy routing to the region has ACKed endpoints
   without it (`XdsServer.lagging`, what `wait_for_ack` waits on; none connected: at once; at
   most `drain.envoy_ack_timeout_s`).
3. summaries: out of the region summaries gateways watch (published at once).
4. dns: out of DNS answers (they follow the summaries); done one DNS TTL later.
5. consul: with `--consul`, the reply says `consul_deregister: true` and the node deregisters
   itself; if it has not within half of `drain.consul_timeout_s`, or it is known from Consul only
   or silent, the control plane deregisters it through the Consul agent API. Done when Consul no
   longer lists it (at most `drain.consul_timeout_s`).
6. in_flight: done when the node reports nothing in flight, or stops beating (at most
   `drain.in_flight_timeout_s`).
7. exit: the reply says `may_exit: true`; done (phase `done`) when the node stops beating.

This module is the sequence as a pure state machine: `advance(drain, node, facts)` returns the
sequence moved as far as the facts allow and its effects (audit entries, a Consul call); each step's
check is a plain function of the sequence, the node and the facts, never a wait. A step whose start
changes routing (envoy: out of EDS; summaries: out of the summaries) ends the advance, so that the
caller applies that change before the step is checked. `control_plane.drain.book` holds every node's
sequence and gathers the facts; the drain loop (`control_plane.fleet.drain_loop`) ticks it and
writes what moved (table `drains`, and an audit entry per step), so a restarted control plane
resumes each sequence at its last recorded step and redoes it; every step's effect is idempotent.
Whether a node should be draining is decided from durable facts (its drain request, its region's
state) and its own reports, whenever they change (`note`) and on every tick: a sequence nobody wants
any more (undrain, region active again, a drained node restarted) is cancelled and the node is back
in routing at once. A node drained by an operator or its region stays drained (`may_exit` keeps
being sent) until undrained.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final, Literal

from control_plane import audit
from control_plane.audit import Actor
from control_plane.model import DONE, PHASES, STEPS, Node, Region, has_reached
from control_plane.settings import Settings
from wire.heartbeat import Heartbeat

ACTOR: Final = Actor(kind="control_plane", client="drain sequence")
# Entering these changes the node's routing: the advance stops for the caller to apply it.
ROUTING_STEPS: Final = frozenset({"envoy", "summaries"})

DrainReason = Literal["operator", "region", "node"]


def num_in_flight(beat: Heartbeat) -> int:
    if beat.num_in_flight is not None:
        return beat.num_in_flight
    return beat.num_running + beat.num_waiting


@dataclass(frozen=True, slots=True)
class StepRecord:
    started_at: float  # Unix seconds
    completed_at: float | None = None
    note: str = ""  # how it ended: "3 Envoys ACKed", "timed out after 5.0 s: ..."


@dataclass(frozen=True, slots=True)
class DrainSequence:
    node_id: str
    region: str
    reason: DrainReason
    started_at: float
    phase: str = STEPS[0]
    steps: Mapping[str, StepRecord] = field(default_factory=dict)
    is_consul_call_made: bool = False  # memory only: after a restart it may be made again

    @property
    def may_exit(self) -> bool:
        return has_reached(self.phase, "exit")


@dataclass(frozen=True, slots=True)
class DrainTimes:
    unhealthy_after_s: float  # step 1's bound, and how long silence means a node is gone
    dns_ttl_s: float | None  # step 4's wait; None without a DNS server
    envoy_ack_timeout_s: float
    consul_timeout_s: float
    in_flight_timeout_s: float

    @classmethod
    def of(cls, settings: Settings) -> DrainTimes:
        return cls(
            unhealthy_after_s=settings.unhealthy_after_s,
            dns_ttl_s=float(settings.dns.ttl_s),
            envoy_ack_timeout_s=settings.drain.envoy_ack_timeout_s,
            consul_timeout_s=settings.drain.consul_timeout_s,
            in_flight_timeout_s=settings.drain.in_flight_timeout_s,
        )


@dataclass(frozen=True, slots=True)
class DrainFacts:
    """What the checks read beyond the sequence and the node, gathered by the caller."""

    now: float  # Unix seconds, on the drain clock
    times: DrainTimes
    is_silent: bool  # the node has stopped beating (or not beaten long enough since a restart)
    lagging_envoys: tuple[str, ...] | None  # Envoys yet to ACK EDS without it; None: no xDS
    num_envoys: int  # Envoys routing to the node's region
    summary_index: int  # of the region summaries published now
    has_consul: bool


@dataclass(frozen=True, slots=True)
class AuditEffect:
    action: str  # drain.start, drain.step, ...
    detail: audit.AuditDetail


@dataclass(frozen=True, slots=True)
class ConsulDeregisterEffect:
    node_id: str


Effect = AuditEffect | ConsulDeregisterEffect


def wanted_reason(
    node: Node, region: Region | None, sequence: DrainSequence | None
) -> DrainReason | None:
    """Why `node` should be draining now, or None. The node's own `draining` counts only for a
    drain it started itself (in a drain we started, it is the node's answer to us)."""
    if node.drain_requested:
        return "operator"
    if region is not None and (region.state == "draining" or region.is_deleting):
        return "region"
    if sequence is not None and sequence.reason == "node" and node.last_beat is None:
        return "node"  # not heard from since a restart: it was draining then
    is_own = sequence is None or sequence.reason == "node"
    if node.reports_draining and is_own:
        return "node"
    return None


def start(node: Node, reason: DrainReason, now: float) -> tuple[DrainSequence, AuditEffect]:
    sequence = DrainSequence(node.node_id, node.identity.region, reason, started_at=now)
    return _enter(sequence, STEPS[0], now), AuditEffect("drain.start", {"reason": reason})


def _enter(sequence: DrainSequence, phase: str, now: float) -> DrainSequence:
    steps = dict(sequence.steps)
    if phase != DONE:
        steps[phase] = StepRecord(started_at=now)
    return dataclasses.replace(sequence, phase=phase, steps=steps)


# --- the steps' checks: a note when done, None while waiting ---

Check = Callable[[DrainSequence, Node, DrainFacts, float], str | None]


def cannot_answer(node: Node, facts: DrainFacts, nothing_to: str) -> str | None:
    """The note of a step that waits for the node's answer, when none can come: the node is
    known from Consul only (`nothing_to` says what there is nothing to do), or it is silent."""
    if not node.is_from_heartbeats:
        return f"known from Consul only: nothing to {nothing_to}"
    if facts.is_silent:
        return "the node is not heartbeating"
    return None


def timed_out(waited_s: float, limit_s: float, why: str) -> str | None:
    """A step's note once it has waited its bound (it ends anyway); None before."""
    return f"timed out after {waited_s:.1f} s{why}" if waited_s >= limit_s else None


def check_admissions(
    sequence: DrainSequence, node: Node, facts: DrainFacts, waited_s: float
) -> str | None:
    if node.is_from_heartbeats and node.reports_draining:
        return "the node reports draining"
    if (note := cannot_answer(node, facts, "tell it")) is not None:
        return note
    limit_s = facts.times.unhealthy_after_s
    return timed_out(waited_s, limit_s, ": the node does not report draining")


def check_envoy(
    sequence: DrainSequence, node: Node, facts: DrainFacts, waited_s: float
) -> str | None:
    if facts.lagging_envoys is None:
        return "no xDS server"
    if not facts.lagging_envoys:
        return f"out of EDS, ACKed by {facts.num_envoys} Envoys"
    lagging = ", ".join(sorted(facts.lagging_envoys))
    return timed_out(waited_s, facts.times.envoy_ack_timeout_s, f": not ACKed by {lagging}")


def check_summaries(
    sequence: DrainSequence, node: Node, facts: DrainFacts, waited_s: float
) -> str | None:
    # Checked only after the advance that entered it ended and the caller published.
    return f"out of the region summaries (index {facts.summary_index})"


def check_dns(
    sequence: DrainSequence, node: Node, facts: DrainFacts, waited_s: float
) -> str | None:
    ttl_s = facts.times.dns_ttl_s
    if ttl_s is None:
        return "no DNS server"
    if waited_s >= ttl_s:
        return f"out of DNS answers; waited one TTL ({ttl_s:g} s)"
    return None


def check_consul(
    sequence: DrainSequence, node: Node, facts: DrainFacts, waited_s: float
) -> str | None:
    if not facts.has_consul:
        return "no Consul"
    if node.consul is None:
        return "out of Consul" + (" (deregistered by us)" if sequence.is_consul_call_made else "")
    return timed_out(waited_s, facts.times.consul_timeout_s, ": still in Consul")


def should_deregister_from_consul(
    sequence: DrainSequence, node: Node, facts: DrainFacts, waited_s: float
) -> bool:
    """The node was told to deregister itself; we do it if it cannot (silent, Consul-only) or
    has not within half of the step's bound."""
    if not facts.has_consul or node.consul is None or sequence.is_consul_call_made:
        return False
    is_on_its_own = node.is_from_heartbeats and not facts.is_silent
    return not is_on_its_own or waited_s >= facts.times.consul_timeout_s / 2


def check_in_flight(
    sequence: DrainSequence, node: Node, facts: DrainFacts, waited_s: float
) -> str | None:
    if (note := cannot_answer(node, facts, "wait for")) is not None:
        return note
    if node.last_beat is None:
        return None
    count = num_in_flight(node.last_beat)
    if count == 0:
        return "nothing in flight"
    return timed_out(waited_s, facts.times.in_flight_timeout_s, f" with {count} in flight")


def check_exit(
    sequence: DrainSequence, node: Node, facts: DrainFacts, waited_s: float
) -> str | None:
    return "the node has stopped" if facts.is_silent else None


CHECKS: Final[Mapping[str, Check]] = {
    "admissions": check_admissions,
    "envoy": check_envoy,
    "summaries": check_summaries,
    "dns": check_dns,
    "consul": check_consul,
    "in_flight": check_in_flight,
    "exit": check_exit,
}


def advance(
    sequence: DrainSequence, node: Node, facts: DrainFacts
) -> tuple[DrainSequence, list[Effect]]:
    """Move `sequence` through every step whose check passes; the same object if none does."""
    effects: list[Effect] = []
    while sequence.phase != DONE:
        record = sequence.steps[sequence.phase]
        waited_s = facts.now - record.started_at
        if sequence.phase == "consul" and should_deregister_from_consul(
            sequence, node, facts, waited_s
        ):
            sequence = dataclasses.replace(sequence, is_consul_call_made=True)
            effects.append(ConsulDeregisterEffect(node.node_id))
        note = CHECKS[sequence.phase](sequence, node, facts, waited_s)
        if note is None:
            break
        steps = dict(sequence.steps)
        steps[sequence.phase] = dataclasses.replace(record, completed_at=facts.now, note=note)
        took_s = round(facts.now - record.started_at, 3)
        detail: audit.AuditDetail = {"step": sequence.phase, "note": note, "took_s": took_s}
        effects.append(AuditEffect("drain.step", detail))
        next_phase = PHASES[PHASES.index(sequence.phase) + 1]
        sequence = _enter(dataclasses.replace(sequence, steps=steps), next_phase, facts.now)
        if next_phase in ROUTING_STEPS:
            break
    return sequence, effects
