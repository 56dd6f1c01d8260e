"""Two `python -m control_plane` replicas on one real PostgreSQL: a change through one reaches the
other; beats received by one count at the other; one leader runs the drains, and another takes
over when it dies (resuming each drain where it stood) or is paused past its lease (SIGSTOP: on
SIGCONT it no longer acts as leader); a leader's write from an old epoch is refused."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from conftest import REPLICA_LEASE_S, ControlPlaneProcess, bearer, heartbeat

from control_plane.drain.sequence import DrainSequence
from control_plane.fleet.sql import FleetStore, NotLeaderError
from control_plane.model import STEPS
from control_plane.store import open_store
from control_plane.tokens import TokenSet

MAX_WAIT_S = 20.0
REGION = {"name": "us-east", "lat": 40.7, "lon": -74.0}
Pair = tuple[ControlPlaneProcess, ControlPlaneProcess]


@pytest.fixture
def pair(start_replica: Any, tokens: TokenSet) -> Pair:
    """Two replicas, a and b; a leads (started first, and waited for)."""
    a = start_replica("a")
    wait_for(lambda: is_leader(a, tokens), "a to lead")
    return a, start_replica("b")


def wait_for(check: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + MAX_WAIT_S
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def status(cp: ControlPlaneProcess, tokens: TokenSet) -> dict[str, Any]:
    response = httpx.get(cp.base_url + "/v1/status", headers=bearer(tokens.admin), timeout=5.0)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def is_leader(cp: ControlPlaneProcess, tokens: TokenSet) -> bool:
    return bool(status(cp, tokens)["replica"]["is_leader"])


def mint(cp: ControlPlaneProcess, tokens: TokenSet, node_id: str) -> str:
    response = httpx.post(
        f"{cp.base_url}/v1/nodes/{node_id}/credential",
        json={"region": "us-east"},
        headers=bearer(tokens.admin),
        timeout=5.0,
    )
    assert response.status_code == 201, response.text
    token: str = response.json()["token"]
    return token


def beat(cp: ControlPlaneProcess, token: str, node_id: str, **fields: Any) -> dict[str, Any]:
    response = httpx.post(
        cp.base_url + "/v1/nodes/heartbeat",
        json=heartbeat(node_id, **fields),
        headers=bearer(token),
        timeout=5.0,
    )
    assert response.status_code == 200, response.text
    reply: dict[str, Any] = response.json()
    return reply


def node_known_at(
    minter: ControlPlaneProcess, beater: ControlPlaneProcess, tokens: TokenSet, node_id: str
) -> str:
    """Mint `node_id`'s credential at `minter`; return it once `beater` accepts its beats."""
    token = mint(minter, tokens, node_id)
    wait_for(
        lambda: (
            httpx.post(
                beater.base_url + "/v1/nodes/heartbeat",
                json=heartbeat(node_id),
                headers=bearer(token),
            ).status_code
            == 200
        ),
        f"{beater.base_url} to accept {node_id}'s credential",
    )
    return token


def drain_of(cp: ControlPlaneProcess, tokens: TokenSet, node_id: str) -> dict[str, Any] | None:
    drains = [d for d in status(cp, tokens)["drains"] if d["node_id"] == node_id]
    return drains[0] if drains else None


def test_changes_and_beats_through_one_replica_reach_the_other(
    pair: Pair, tokens: TokenSet
) -> None:
    a, b = pair
    admin = bearer(tokens.admin)
    assert httpx.post(a.base_url + "/v1/regions", json=REGION, headers=admin).status_code == 201
    wait_for(
        lambda: httpx.get(b.base_url + "/v1/regions/us-east", headers=admin).status_code == 200,
        "the region at b",
    )
    # A credential minted at b works at a; the node beats to a only, and counts at b too.
    token = node_known_at(b, a, tokens, "n1")
    wait_for(lambda: status(b, tokens)["num_healthy_nodes"] == 1, "n1 healthy at b")
    summary = httpx.get(b.base_url + "/v1/regions/summary", headers=bearer(tokens.gateway)).json()
    assert [(r["name"], r["healthy_nodes"]) for r in summary["regions"]] == [("us-east", 1)]
    # A drain asked at b is run by the leader (a), and b follows its phases.
    assert httpx.post(b.base_url + "/v1/nodes/n1/drain", headers=admin).status_code == 200
    assert beat(a, token, "n1", draining=True, num_running=0, num_waiting=0)["drain"] is True
    wait_for(
        lambda: (drain_of(b, tokens, "n1") or {}).get("phase") == "dns", "b to follow the drain"
    )
    # Deleting the node at a removes it at b.
    assert httpx.post(a.base_url + "/v1/nodes/n1/undrain", headers=admin).status_code == 200
    assert httpx.delete(a.base_url + "/v1/nodes/n1", headers=admin).status_code == 204
    wait_for(lambda: status(b, tokens)["num_nodes"] == 0, "n1 gone at b")


def test_a_regions_picker_set_at_one_replica_reaches_the_other(
    pair: Pair, tokens: TokenSet
) -> None:
    a, b = pair
    admin = bearer(tokens.admin)
    assert httpx.post(a.base_url + "/v1/regions", json=REGION, headers=admin).status_code == 201

    def picker_at_b() -> object:
        return httpx.get(b.base_url + "/v1/regions/us-east", headers=admin).json()["picker"]

    def set_at_a_then_seen_at_b(picker: str | None) -> None:
        patch = {"picker": picker}
        patched = httpx.patch(a.base_url + "/v1/regions/us-east", json=patch, headers=admin)
        assert patched.status_code == 200, patched.text
        wait_for(lambda: picker_at_b() == picker, f"picker {picker} at b")

    set_at_a_then_seen_at_b("127.0.0.1:9100")
    set_at_a_then_seen_at_b(None)


def test_a_dead_leaders_drains_resume_at_the_new_leader(pair: Pair, tokens: TokenSet) -> None:
    a, b = pair
    admin = bearer(tokens.admin)
    assert httpx.post(a.base_url + "/v1/regions", json=REGION, headers=admin).status_code == 201
    token = node_known_at(a, b, tokens, "n1")
    assert httpx.post(a.base_url + "/v1/nodes/n1/drain", headers=admin).status_code == 200

    def in_dns() -> bool:
        beat(b, token, "n1", draining=True, num_running=0, num_waiting=0)
        return (drain_of(a, tokens, "n1") or {}).get("phase") == "dns"

    wait_for(in_dns, "the drain to reach the DNS wait at a")
    started_at = drain_of(a, tokens, "n1")["started_at"]  # type: ignore[index]
    a.kill()
    wait_for(lambda: is_leader(b, tokens), "b to take over")

    def past_dns() -> dict[str, Any] | None:
        beat(b, token, "n1", draining=True, num_running=0, num_waiting=0)
        drain = drain_of(b, tokens, "n1")
        return drain if drain and STEPS.index(drain["phase"]) > STEPS.index("dns") else None

    drain = wait_for(past_dns, "b to move the drain on")
    assert drain["started_at"] == started_at  # resumed, not restarted
    entries = httpx.get(b.base_url + "/v1/audit?limit=1000", headers=admin).json()["entries"]
    assert [e["action"] for e in entries].count("drain.start") == 1


def test_a_leader_paused_past_its_lease_no_longer_leads_when_it_resumes(
    pair: Pair, tokens: TokenSet, pg_url: str
) -> None:
    a, b = pair
    epoch_a = status(a, tokens)["replica"]["epoch"]
    assert not is_leader(b, tokens)
    os.kill(a.proc.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: is_leader(b, tokens), "b to take over")
        time.sleep(REPLICA_LEASE_S)  # a stays stopped well past its lease
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
    # Its very first answer after resuming: not the leader (its own clock says the lease ran out).
    first = status(a, tokens)["replica"]
    assert first == {"id": "a", "is_leader": False, "epoch": None}
    epoch_b = status(b, tokens)["replica"]["epoch"]
    assert epoch_b > epoch_a
    # a's lease loop wakes, finds its session ended, and stays a follower.
    time.sleep(REPLICA_LEASE_S)
    assert not is_leader(a, tokens) and is_leader(b, tokens)
    store = open_store(pg_url)
    try:
        holder = store.read_sync(
            lambda conn: conn.execute("SELECT holder, epoch FROM leader_lease").fetchone()
        )
        assert (holder["holder"], holder["epoch"]) == ("b", epoch_b)
    finally:
        store.close()


@pytest.mark.asyncio
async def test_a_drain_write_from_an_old_epoch_is_refused(pg_url: str) -> None:
    store = open_store(pg_url)
    try:
        store.write_sync(
            lambda conn: conn.execute(
                "INSERT INTO leader_lease (one, holder, epoch, backend_pid, renewed_at) "
                "VALUES (1, 'b', 8, 0, 0)"
            )
        )
        fleet_store = FleetStore(store)
        sequence = DrainSequence("n1", "us-east", "operator", started_at=0.0)
        with pytest.raises(NotLeaderError, match="epoch 7"):
            await fleet_store.write_drains({"n1": sequence}, [], 0.0, epoch=7)
        await fleet_store.write_drains({"n1": sequence}, [], 0.0, epoch=8)
        rows = store.read_sync(lambda conn: conn.execute("SELECT node_id FROM drains").fetchall())
        assert [row["node_id"] for row in rows] == ["n1"]
    finally:
        store.close()
