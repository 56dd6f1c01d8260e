"""The drain sequence as a state machine (control_plane/drain.py), on real parts without servers:
the registry, the fleet, the store, the summary publisher and an unstarted xDS server, with a fake
clock. Order of the steps, idempotence, undrain, restart recovery, region drains and deletes."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import heartbeat
from test_xds_plan import INGRESS

from control_plane.audit import Actor
from control_plane.changes import ChangeFeed
from control_plane.drain import (
    ACTOR,
    DONE,
    PHASES,
    STEPS,
    Drainer,
    DrainTimes,
    has_reached,
    load_drains,
)
from control_plane.fleet import Fleet, Node
from control_plane.node_credentials import CredentialRegistry
from control_plane.registry import Registry, load_fleet
from control_plane.schemas import RegionCreate, RegionPatch
from control_plane.store import Store
from control_plane.summaries import SummaryPublisher
from control_plane.xds.plan import plan_ingress
from control_plane.xds.server import XdsServer
from wire.heartbeat import Heartbeat
from wire.routing_policy import RoutingPolicy

ADMIN = Actor(kind="admin", client="test")
NODE = Actor(kind="node", client="test")
DNS_TTL_S = 5.0
TIMES = DrainTimes(
    unhealthy_after_s=3.0,
    dns_ttl_s=DNS_TTL_S,
    envoy_ack_timeout_s=2.0,
    consul_timeout_s=4.0,
    in_flight_timeout_s=30.0,
)
PORTS = {"a": 9001, "b": 9002}


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Rig:
    """The control plane's parts that a drain moves, wired as the app wires them."""

    store: Store
    fleet: Fleet
    publisher: SummaryPublisher
    xds: XdsServer
    drainer: Drainer
    registry: Registry
    clock: Clock

    async def beat(self, node_id: str, **fields: Any) -> Node:
        body = heartbeat(node_id, url=f"http://127.0.0.1:{PORTS[node_id]}", **fields)
        return await self.registry.record_heartbeat(NODE, Heartbeat.model_validate(body))

    def in_eds(self) -> set[str]:
        return plan_ingress(INGRESS, self.fleet).endpoint_ids()

    def in_summary(self) -> int:
        (region,) = self.publisher.current.regions
        return region.healthy_nodes

    def phase(self, node_id: str) -> str:
        return self.drainer.sequences[node_id].phase

    def go_silent(self, node_id: str) -> None:
        self.fleet.nodes[node_id].is_beating = False  # what the sweep does after missed beats

    def audit(self) -> list[tuple[str, str, dict[str, Any]]]:
        rows = self.store.read_sync(
            lambda conn: conn.execute("SELECT action, target, detail FROM audit_log").fetchall()
        )
        return [(row["action"], row["target"], json.loads(row["detail"])) for row in rows]


def build(path: Path, clock: Clock) -> Rig:
    store = Store(str(path))
    fleet = store.read_sync(lambda conn: load_fleet(conn, TIMES.unhealthy_after_s))
    feed = ChangeFeed(1)
    publisher = SummaryPublisher(fleet, RoutingPolicy, feed)
    xds = XdsServer(fleet, feed, refresh_interval_s=0.05)

    async def finish_region_delete(name: str) -> None:
        await registry.finish_region_delete(ACTOR, name)

    def publish_now() -> None:
        publisher.refresh()

    drainer = Drainer(fleet, store, publisher, xds, TIMES, finish_region_delete, clock=clock)
    drainer.restore(store.read_sync(load_drains))
    registry = Registry(
        store,
        fleet,
        CredentialRegistry(store, []),  # beats here skip auth: no credentials to check
        on_change=publish_now,
        on_capacity=publisher.mark_dirty,
        note_drain=drainer.note,
    )
    return Rig(store, fleet, publisher, xds, drainer, registry, clock)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    built = build(tmp_path / "cp.db", Clock())
    yield built
    built.store.close()


async def two_nodes(rig: Rig) -> None:
    await rig.registry.create_region(ADMIN, RegionCreate(name="us-east", lat=40.7, lon=-74.0))
    await rig.beat("a")
    await rig.beat("b")
    assert rig.in_eds() == {"a", "b"} and rig.in_summary() == 2


async def drive_to(rig: Rig, node_id: str, phase: str) -> None:
    """Play a well-behaved node agent and let time pass until `node_id` reaches `phase`."""
    for _ in range(10):
        if rig.phase(node_id) == phase:
            return
        await rig.beat(node_id, draining=True, num_running=0, num_waiting=0)
        await rig.drainer.step()
        if rig.phase(node_id) == "dns" and phase != "dns":
            rig.clock.now += DNS_TTL_S
    raise AssertionError(f"{node_id} is in {rig.phase(node_id)}, not {phase}")


@pytest.mark.asyncio
async def test_steps_run_in_order_each_after_the_one_before(rig: Rig) -> None:
    await two_nodes(rig)
    await rig.registry.set_drain(ADMIN, "b", drain=True)
    await rig.drainer.step()
    # 1. Told to stop admitting; in routing until it says it has.
    assert rig.phase("b") == "admissions"
    assert rig.in_eds() == {"a", "b"} and rig.in_summary() == 2
    await rig.beat("b", draining=True, num_running=2, num_waiting=1)
    await rig.drainer.step()
    # 2-3. No Envoy connected: EDS at once; then the summaries; 4. DNS waits one TTL.
    assert rig.phase("b") == "dns"
    assert rig.in_eds() == {"a"} and rig.in_summary() == 1
    rig.clock.now += DNS_TTL_S
    await rig.drainer.step()
    # 5. No Consul; 6. three requests in flight.
    assert rig.phase("b") == "in_flight"
    await rig.beat("b", draining=True, num_running=0, num_waiting=0, num_in_flight=1)
    await rig.drainer.step()
    assert rig.phase("b") == "in_flight"  # the node's own count wins over the engine's
    await rig.beat("b", draining=True, num_running=0, num_waiting=0, num_in_flight=0)
    await rig.drainer.step()
    # 7. Told it may exit; done once it stops beating.
    assert rig.phase("b") == "exit" and has_reached(rig.fleet.nodes["b"].drain_phase, "exit")
    rig.go_silent("b")
    await rig.drainer.step()
    sequence = rig.drainer.sequences["b"]
    assert sequence.phase == DONE and sequence.may_exit

    records = [sequence.steps[name] for name in STEPS]
    for before, after in itertools.pairwise(records):
        assert before.completed_at is not None and before.completed_at <= after.started_at
    steps = [d["step"] for action, target, d in rig.audit() if action == "drain.step"]
    assert steps == list(STEPS)
    notes = {d["step"]: d["note"] for action, _, d in rig.audit() if action == "drain.step"}
    assert notes["admissions"] == "the node reports draining"
    assert notes["envoy"] == "out of EDS, ACKed by 0 Envoys"
    assert notes["dns"] == "out of DNS answers; waited one TTL (5 s)"
    assert notes["consul"] == "no Consul"
    assert rig.store.read_sync(load_drains)[0].phase == DONE


@pytest.mark.asyncio
async def test_each_wait_is_bounded(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    await two_nodes(rig)
    await rig.registry.set_drain(ADMIN, "b", drain=True)
    # The node never says it stopped admitting: moved on after `unhealthy_after_s`.
    rig.clock.now += TIMES.unhealthy_after_s
    monkeypatch.setattr(rig.xds, "lagging", lambda region, condition: ["envoy-7"])
    await rig.drainer.step()
    assert rig.phase("b") == "envoy"
    # An Envoy that never ACKs holds the drain for `envoy_ack_timeout_s`, no longer.
    rig.clock.now += TIMES.envoy_ack_timeout_s - 0.1
    await rig.drainer.step()
    assert rig.phase("b") == "envoy"
    rig.clock.now += 0.1
    await rig.drainer.step()
    assert rig.phase("b") == "dns"
    note = rig.drainer.sequences["b"].steps["envoy"].note
    assert note == "timed out after 2.0 s: not ACKed by envoy-7"
    rig.clock.now += DNS_TTL_S
    await rig.beat("b", num_running=4)
    await rig.drainer.step()
    assert rig.phase("b") == "in_flight"
    rig.clock.now += TIMES.in_flight_timeout_s
    await rig.drainer.step()
    assert rig.drainer.sequences["b"].steps["in_flight"].note.endswith("with 6 in flight")
    assert rig.phase("b") == "exit"


@pytest.mark.asyncio
async def test_envoy_step_ends_when_every_envoy_has_acked(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    await two_nodes(rig)
    lagging = ["envoy-1", "envoy-2"]
    monkeypatch.setattr(rig.xds, "lagging", lambda region, condition: list(lagging))
    await rig.beat("b", draining=True)  # on its own (SIGTERM): step 1 is done at once
    await rig.drainer.step()
    assert rig.phase("b") == "envoy" and rig.in_eds() == {"a"} and rig.in_summary() == 2
    lagging.pop()
    await rig.drainer.step()
    assert rig.phase("b") == "envoy"
    lagging.pop()
    await rig.drainer.step()
    assert rig.phase("b") == "dns" and rig.in_summary() == 1


@pytest.mark.asyncio
async def test_drain_is_idempotent(rig: Rig) -> None:
    await two_nodes(rig)
    await rig.registry.set_drain(ADMIN, "b", drain=True)
    first = rig.drainer.sequences["b"]
    await rig.drainer.step()
    num_entries = len(rig.audit())
    await rig.registry.set_drain(ADMIN, "b", drain=True)
    rig.drainer.note(rig.fleet.nodes["b"])
    await rig.drainer.step()
    await rig.drainer.step()
    assert rig.drainer.sequences["b"] is first and first.phase == "admissions"
    # Only the operator's second request is new in the log; the sequence did not restart.
    assert [action for action, _, _ in rig.audit()[num_entries:]] == ["node.drain"]


@pytest.mark.asyncio
async def test_undrain_cancels_the_sequence_and_restores_routing(rig: Rig) -> None:
    await two_nodes(rig)
    await rig.registry.set_drain(ADMIN, "b", drain=True)
    await drive_to(rig, "b", "dns")
    assert rig.in_eds() == {"a"} and rig.in_summary() == 1

    await rig.registry.set_drain(ADMIN, "b", drain=False)
    assert "b" not in rig.drainer.sequences
    assert rig.in_eds() == {"a", "b"} and rig.in_summary() == 2
    # The node's next beat still says draining (made before it heard): an echo, no new drain.
    node = await rig.beat("b", draining=True)
    await rig.drainer.step()
    assert rig.drainer.sequences == {} and not node.is_draining
    assert rig.store.read_sync(load_drains) == []
    assert [a for a, _, _ in rig.audit() if a.startswith("drain.")][-1] == "drain.cancel"
    # A beat after that saying draining is the node's own (it got SIGTERM): a new drain.
    await rig.beat("b", draining=True)
    assert rig.drainer.sequences["b"].reason == "node"


@pytest.mark.asyncio
async def test_sequence_survives_a_restart(tmp_path: Path) -> None:
    clock = Clock()
    rig = build(tmp_path / "cp.db", clock)
    await two_nodes(rig)
    await rig.registry.set_drain(ADMIN, "b", drain=True)
    await drive_to(rig, "b", "dns")
    await rig.beat("a", draining=True)  # a drains on its own too
    await rig.drainer.step()
    before = {
        n: (s.phase, s.steps["admissions"].completed_at) for n, s in rig.drainer.sequences.items()
    }
    rig.store.close()

    again = build(tmp_path / "cp.db", clock)
    try:
        after = {
            n: (s.phase, s.steps["admissions"].completed_at)
            for n, s in again.drainer.sequences.items()
        }
        assert after == before == {"a": ("dns", after["a"][1]), "b": ("dns", after["b"][1])}
        b = again.fleet.nodes["b"]
        assert b.is_out_of_eds and b.is_out_of_summaries and b.drain_phase == "dns"
        # Nobody has beaten since the restart: the node's own drain is not taken as ended.
        await again.drainer.step()
        assert set(again.drainer.sequences) == {"a", "b"}
        # b beats again: still out of EDS, and its sequence goes on where it was.
        await again.beat("b", draining=True, num_running=0, num_waiting=0)
        assert again.in_eds() == set()
        clock.now += DNS_TTL_S
        await again.drainer.step()
        assert again.phase("b") == "exit"
        # a was restarted meanwhile and reports it is not draining: its drain ends.
        await again.beat("a", draining=False)
        assert "a" not in again.drainer.sequences and again.in_eds() == {"a"}
    finally:
        again.store.close()


@pytest.mark.asyncio
async def test_a_node_drained_on_its_own_and_restarted_is_back(rig: Rig) -> None:
    await two_nodes(rig)
    await rig.beat("b", draining=True)
    assert rig.drainer.sequences["b"].reason == "node"
    await drive_to(rig, "b", "exit")
    rig.go_silent("b")
    await rig.drainer.step()
    assert rig.phase("b") == DONE
    await rig.beat("b", draining=False)  # a new process
    assert "b" not in rig.drainer.sequences and rig.in_eds() == {"a", "b"}


@pytest.mark.asyncio
async def test_region_drain_runs_every_node_and_active_cancels(rig: Rig) -> None:
    await two_nodes(rig)
    await rig.registry.update_region(ADMIN, "us-east", RegionPatch(state="draining"))
    assert {n: s.reason for n, s in rig.drainer.sequences.items()} == {"a": "region", "b": "region"}
    await rig.beat("a", draining=True)
    await rig.drainer.step()
    assert rig.phase("a") == "dns" and rig.phase("b") == "admissions"
    await rig.registry.update_region(ADMIN, "us-east", RegionPatch(state="active"))
    assert rig.drainer.sequences == {} and rig.in_eds() == {"a", "b"}


@pytest.mark.asyncio
async def test_region_delete_drains_its_nodes_then_forgets_them(rig: Rig) -> None:
    await two_nodes(rig)
    region = await rig.registry.delete_region(ADMIN, "us-east")
    assert region is not None and region.is_deleting and region.state == "draining"
    assert await rig.registry.delete_region(ADMIN, "us-east") == region  # idempotent
    await drive_to(rig, "a", "exit")
    assert "us-east" in rig.fleet.regions  # b has not been told to exit yet
    await drive_to(rig, "b", "exit")
    await rig.drainer.step()
    assert rig.fleet.regions == {} and rig.fleet.nodes == {} and rig.drainer.sequences == {}
    assert rig.store.read_sync(load_drains) == []
    deleted = [(a, d) for a, t, d in rig.audit() if a.startswith("region.delete")]
    assert deleted == [
        ("region.delete", {"drain_first": True}),
        ("region.deleted", {"num_nodes_removed": 2}),
    ]
    # A region without nodes goes at once.
    await rig.registry.create_region(ADMIN, RegionCreate(name="empty", lat=0.0, lon=0.0))
    assert await rig.registry.delete_region(ADMIN, "empty") is None


def test_phases_are_the_steps_then_done() -> None:
    assert (*STEPS, DONE) == PHASES
    assert STEPS == ("admissions", "envoy", "summaries", "dns", "consul", "in_flight", "exit")
    assert has_reached("dns", "summaries") and not has_reached("summaries", "dns")
    assert not has_reached(None, "admissions")
