"""The drain sequence (control_plane/drain/sequence.py, moved by control_plane/drain/book.py and
written by the drain loop), on the app's own parts without servers: `control_plane.app.build` on a
real store with an unstarted xDS server and a fake clock. Order of the steps, idempotence, undrain,
restart recovery, region drains and deletes; each test runs on SQLite and on PostgreSQL."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from conftest import heartbeat, make_settings, new_tokens
from test_xds_plan import INGRESS

from control_plane.app import build, load
from control_plane.audit import Actor
from control_plane.drain.book import DrainBook
from control_plane.drain.envoy_reports import ALIVE_S, EnvoyAcks, PeerReports
from control_plane.fleet.drain_loop import DrainLoop
from control_plane.fleet.registry import Registry
from control_plane.fleet.sql import load_drains
from control_plane.model import DONE, PHASES, STEPS, Fleet, Node, has_reached
from control_plane.schemas import RegionCreate, RegionPatch
from control_plane.settings import DrainConfig, Settings
from control_plane.store import open_store
from control_plane.store.base import Store
from control_plane.summaries import SummaryPublisher
from control_plane.xds.plan import plan_ingress
from control_plane.xds.server import XdsServer
from wire.heartbeat import Heartbeat

ADMIN = Actor(kind="admin", client="test")
NODE = Actor(kind="node", client="test")
DNS_TTL_S = 5.0
UNHEALTHY_AFTER_S = 3.0
DRAIN = DrainConfig(envoy_ack_timeout_s=2.0, consul_timeout_s=4.0, in_flight_timeout_s=30.0)
PORTS = {"a": 9001, "b": 9002}


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Rig:
    """The control plane's parts that a drain moves, as the app builds them."""

    store: Store
    fleet: Fleet
    publisher: SummaryPublisher
    xds: XdsServer
    drains: DrainBook
    peer_envoys: PeerReports
    registry: Registry
    drain_loop: DrainLoop
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
        return self.drains.sequences[node_id].phase

    def go_silent(self, node_id: str) -> None:
        self.fleet.nodes[node_id].is_beating = False  # what the sweep does after missed beats

    def audit(self) -> list[tuple[str, str, dict[str, Any]]]:
        rows = self.store.read_sync(
            lambda conn: conn.execute(
                "SELECT action, target, detail FROM audit_log ORDER BY id"
            ).fetchall()
        )
        return [(row["action"], row["target"], json.loads(row["detail"])) for row in rows]


def settings_for(db: str) -> Settings:
    return make_settings(
        db,
        new_tokens(),
        heartbeat_interval_s=UNHEALTHY_AFTER_S / 3,
        missed_beats=3,
        dns={"ttl_s": int(DNS_TTL_S)},
        drain=DRAIN,
    )


def build_rig(db: str, clock: Clock) -> Rig:
    settings = settings_for(db)
    store = open_store(db)
    services = build(
        settings, new_tokens(), store, store.read_sync(lambda c: load(c, settings)), clock
    )
    assert services.xds is not None
    return Rig(
        store,
        services.fleet,
        services.summaries,
        services.xds,
        services.drains,
        services.peer_envoys,
        services.registry,
        services.drain_loop,
        clock,
    )


@pytest.fixture
def rig(db: str) -> Iterator[Rig]:
    built = build_rig(db, Clock())
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
        await rig.drain_loop.step()
        if rig.phase(node_id) == "dns" and phase != "dns":
            rig.clock.now += DNS_TTL_S
    raise AssertionError(f"{node_id} is in {rig.phase(node_id)}, not {phase}")


@pytest.mark.asyncio
async def test_steps_run_in_order_each_after_the_one_before(rig: Rig) -> None:
    await two_nodes(rig)
    await rig.registry.set_drain(ADMIN, "b", drain=True)
    await rig.drain_loop.step()
    # 1. Told to stop admitting; in routing until it says it has.
    assert rig.phase("b") == "admissions"
    assert rig.in_eds() == {"a", "b"} and rig.in_summary() == 2
    await rig.beat("b", draining=True, num_running=2, num_waiting=1)
    await rig.drain_loop.step()
    # 2-3. No Envoy connected: EDS at once; then the summaries; 4. DNS waits one TTL.
    assert rig.phase("b") == "dns"
    assert rig.in_eds() == {"a"} and rig.in_summary() == 1
    rig.clock.now += DNS_TTL_S
    await rig.drain_loop.step()
    # 5. No Consul; 6. three requests in flight.
    assert rig.phase("b") == "in_flight"
    await rig.beat("b", draining=True, num_running=0, num_waiting=0, num_in_flight=1)
    await rig.drain_loop.step()
    assert rig.phase("b") == "in_flight"  # the node's own count wins over the engine's
    await rig.beat("b", draining=True, num_running=0, num_waiting=0, num_in_flight=0)
    await rig.drain_loop.step()
    # 7. Told it may exit; done once it stops beating.
    assert rig.phase("b") == "exit" and has_reached(rig.fleet.nodes["b"].drain_phase, "exit")
    rig.go_silent("b")
    await rig.drain_loop.step()
    sequence = rig.drains.sequences["b"]
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
    rig.clock.now += UNHEALTHY_AFTER_S
    monkeypatch.setattr(rig.xds, "lagging", lambda region, condition: ["envoy-7"])
    await rig.drain_loop.step()
    assert rig.phase("b") == "envoy"
    # An Envoy that never ACKs holds the drain for `envoy_ack_timeout_s`, no longer.
    rig.clock.now += DRAIN.envoy_ack_timeout_s - 0.1
    await rig.drain_loop.step()
    assert rig.phase("b") == "envoy"
    rig.clock.now += 0.1
    await rig.drain_loop.step()
    assert rig.phase("b") == "dns"
    note = rig.drains.sequences["b"].steps["envoy"].note
    assert note == "timed out after 2.0 s: not ACKed by envoy-7"
    rig.clock.now += DNS_TTL_S
    await rig.beat("b", num_running=4)
    await rig.drain_loop.step()
    assert rig.phase("b") == "in_flight"
    rig.clock.now += DRAIN.in_flight_timeout_s
    await rig.drain_loop.step()
    assert rig.drains.sequences["b"].steps["in_flight"].note.endswith("with 6 in flight")
    assert rig.phase("b") == "exit"


@pytest.mark.asyncio
async def test_envoy_step_ends_when_every_envoy_has_acked(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    await two_nodes(rig)
    lagging = ["envoy-1", "envoy-2"]
    monkeypatch.setattr(rig.xds, "lagging", lambda region, condition: list(lagging))
    await rig.beat("b", draining=True)  # on its own (SIGTERM): step 1 is done at once
    await rig.drain_loop.step()
    assert rig.phase("b") == "envoy" and rig.in_eds() == {"a"} and rig.in_summary() == 2
    lagging.pop()
    await rig.drain_loop.step()
    assert rig.phase("b") == "envoy"
    lagging.pop()
    await rig.drain_loop.step()
    assert rig.phase("b") == "dns" and rig.in_summary() == 1


@pytest.mark.asyncio
async def test_envoy_step_waits_for_every_living_replicas_envoys(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    await two_nodes(rig)
    monkeypatch.setattr(rig.xds, "lagging", lambda region, condition: [])  # ours have ACKed
    peers = rig.peer_envoys
    # Replica p has not heard of the step yet; replica q's Envoy has not ACKed; r is long dead.
    peers.follow(
        [
            ("p", {}, 0.0),
            ("q", {"b": EnvoyAcks(2, ("envoy-q2",))}, 0.0),
            ("r", {"b": EnvoyAcks(1, ("envoy-r1",))}, ALIVE_S),
        ]
    )
    await rig.beat("b", draining=True)
    await rig.drain_loop.step()
    assert rig.phase("b") == "envoy"
    acks = peers.acks_for("b")
    assert acks == EnvoyAcks(2, ("replica p (no report yet)", "envoy-q2 (at replica q)"))
    peers.follow([("p", {"b": EnvoyAcks(1, ())}, 0.0), ("q", {"b": EnvoyAcks(2, ())}, 0.0)])
    await rig.drain_loop.step()
    assert rig.phase("b") == "dns"
    assert rig.drains.sequences["b"].steps["envoy"].note == "out of EDS, ACKed by 3 Envoys"


@pytest.mark.asyncio
async def test_drain_is_idempotent(rig: Rig) -> None:
    await two_nodes(rig)
    await rig.registry.set_drain(ADMIN, "b", drain=True)
    first = rig.drains.sequences["b"]
    await rig.drain_loop.step()
    num_entries = len(rig.audit())
    await rig.registry.set_drain(ADMIN, "b", drain=True)
    rig.drains.note(rig.fleet.nodes["b"])
    await rig.drain_loop.step()
    await rig.drain_loop.step()
    assert rig.drains.sequences["b"] is first and first.phase == "admissions"
    # Only the operator's second request is new in the log; the sequence did not restart.
    assert [action for action, _, _ in rig.audit()[num_entries:]] == ["node.drain"]


@pytest.mark.asyncio
async def test_undrain_cancels_the_sequence_and_restores_routing(rig: Rig) -> None:
    await two_nodes(rig)
    await rig.registry.set_drain(ADMIN, "b", drain=True)
    await drive_to(rig, "b", "dns")
    assert rig.in_eds() == {"a"} and rig.in_summary() == 1

    await rig.registry.set_drain(ADMIN, "b", drain=False)
    assert "b" not in rig.drains.sequences
    assert rig.in_eds() == {"a", "b"} and rig.in_summary() == 2
    # The node's next beat still says draining (made before it heard): an echo, no new drain.
    node = await rig.beat("b", draining=True)
    await rig.drain_loop.step()
    assert rig.drains.sequences == {} and not node.is_draining
    assert rig.store.read_sync(load_drains) == []
    assert [a for a, _, _ in rig.audit() if a.startswith("drain.")][-1] == "drain.cancel"
    # A beat after that saying draining is the node's own (it got SIGTERM): a new drain.
    await rig.beat("b", draining=True)
    assert rig.drains.sequences["b"].reason == "node"


@pytest.mark.asyncio
async def test_sequence_survives_a_restart(db: str) -> None:
    clock = Clock()
    rig = build_rig(db, clock)
    await two_nodes(rig)
    await rig.registry.set_drain(ADMIN, "b", drain=True)
    await drive_to(rig, "b", "dns")
    await rig.beat("a", draining=True)  # a drains on its own too
    await rig.drain_loop.step()
    before = {
        n: (s.phase, s.steps["admissions"].completed_at) for n, s in rig.drains.sequences.items()
    }
    rig.store.close()

    again = build_rig(db, clock)
    try:
        after = {
            n: (s.phase, s.steps["admissions"].completed_at)
            for n, s in again.drains.sequences.items()
        }
        assert after == before == {"a": ("dns", after["a"][1]), "b": ("dns", after["b"][1])}
        b = again.fleet.nodes["b"]
        assert b.is_out_of_eds and b.is_out_of_summaries and b.drain_phase == "dns"
        # Nobody has beaten since the restart: the node's own drain is not taken as ended.
        await again.drain_loop.step()
        assert set(again.drains.sequences) == {"a", "b"}
        # b beats again: still out of EDS, and its sequence goes on where it was.
        await again.beat("b", draining=True, num_running=0, num_waiting=0)
        assert again.in_eds() == set()
        clock.now += DNS_TTL_S
        await again.drain_loop.step()
        assert again.phase("b") == "exit"
        # a was restarted meanwhile and reports it is not draining: its drain ends.
        await again.beat("a", draining=False)
        assert "a" not in again.drains.sequences and again.in_eds() == {"a"}
    finally:
        again.store.close()


@pytest.mark.asyncio
async def test_a_node_drained_on_its_own_and_restarted_is_back(rig: Rig) -> None:
    await two_nodes(rig)
    await rig.beat("b", draining=True)
    assert rig.drains.sequences["b"].reason == "node"
    await drive_to(rig, "b", "exit")
    rig.go_silent("b")
    await rig.drain_loop.step()
    assert rig.phase("b") == DONE
    await rig.beat("b", draining=False)  # a new process
    assert "b" not in rig.drains.sequences and rig.in_eds() == {"a", "b"}


@pytest.mark.asyncio
async def test_region_drain_runs_every_node_and_active_cancels(rig: Rig) -> None:
    await two_nodes(rig)
    await rig.registry.update_region(ADMIN, "us-east", RegionPatch(state="draining"))
    assert {n: s.reason for n, s in rig.drains.sequences.items()} == {"a": "region", "b": "region"}
    await rig.beat("a", draining=True)
    await rig.drain_loop.step()
    assert rig.phase("a") == "dns" and rig.phase("b") == "admissions"
    await rig.registry.update_region(ADMIN, "us-east", RegionPatch(state="active"))
    assert rig.drains.sequences == {} and rig.in_eds() == {"a", "b"}


@pytest.mark.asyncio
async def test_region_delete_drains_its_nodes_then_forgets_them(rig: Rig) -> None:
    await two_nodes(rig)
    region = await rig.registry.delete_region(ADMIN, "us-east")
    assert region is not None and region.is_deleting and region.state == "draining"
    assert await rig.registry.delete_region(ADMIN, "us-east") == region  # idempotent
    await drive_to(rig, "a", "exit")
    assert "us-east" in rig.fleet.regions  # b has not been told to exit yet
    await drive_to(rig, "b", "exit")
    await rig.drain_loop.step()
    assert rig.fleet.regions == {} and rig.fleet.nodes == {} and rig.drains.sequences == {}
    assert rig.store.read_sync(load_drains) == []
    deleted = [(a, d) for a, t, d in rig.audit() if a.startswith("region.delete")]
    assert [(action, {k: v for k, v in d.items() if k != "old"}) for action, d in deleted] == [
        ("region.delete", {"drain_first": True}),
        ("region.deleted", {"num_nodes_removed": 2}),
    ]
    assert deleted[0][1]["old"] == {"state": "active", "is_deleting": False}
    assert deleted[1][1]["old"]["state"] == "draining"
    # A region without nodes goes at once.
    await rig.registry.create_region(ADMIN, RegionCreate(name="empty", lat=0.0, lon=0.0))
    assert await rig.registry.delete_region(ADMIN, "empty") is None


def test_phases_are_the_steps_then_done() -> None:
    assert (*STEPS, DONE) == PHASES
    assert STEPS == ("admissions", "envoy", "summaries", "dns", "consul", "in_flight", "exit")
    assert has_reached("dns", "summaries") and not has_reached("summaries", "dns")
    assert not has_reached(None, "admissions")
