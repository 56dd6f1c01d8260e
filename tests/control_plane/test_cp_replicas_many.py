"""Beats shared between replicas at fleet scale: a thousand nodes beating to the leader all count
healthy at the follower (the leader's health saves carry hundreds of beats each, and the follower
reads them back in overlapping windows: none may be lost). The 1,000-node benchmark once showed
the follower counting none; this test showed the sharing was not the cause (the benchmark's
window was: see docs/benchmarks.md)."""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

import httpx
from conftest import ControlPlaneProcess, bearer, heartbeat
from test_cp_replicas import REGION, is_leader, status, wait_for

from control_plane.fleet.credentials import TOKEN_PREFIX
from control_plane.hashed_secrets import hash_secret
from control_plane.store import open_store
from control_plane.tokens import TokenSet

NUM_NODES = 1000
# Long enough that each node's one beat keeps it healthy for the whole test: what is tested is
# that every beat arrives, not how fast.
HEARTBEAT_INTERVAL_S = 60.0


def mint_all(pg_url: str, node_ids: list[str]) -> list[str]:
    """Every node's credential, written straight to the store in one transaction (the API
    would mint them one by one: minutes on a loaded machine, and not what is tested here)."""
    tokens = [TOKEN_PREFIX + secrets.token_urlsafe(32) for _ in node_ids]
    now = time.time()
    pairs = zip(node_ids, tokens, strict=True)
    rows = [(n, "us-east", None, hash_secret(t), now, now) for n, t in pairs]
    store = open_store(pg_url)
    try:
        store.write_sync(
            lambda conn: conn.executemany(
                "INSERT INTO node_credentials (node_id, region, url, secret_sha256, "
                "created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?)",
                rows,
            ),
            ("credentials",),
        )
    finally:
        store.close()
    return tokens


async def beat_all(cp: ControlPlaneProcess, node_ids: list[str], tokens: list[str]) -> None:
    # Idle connections dropped well before the control plane's 5 s keep-alive ends them: a
    # beat sent on one the server is closing fails (ReadError) on a loaded machine.
    limits = httpx.Limits(keepalive_expiry=1.0)
    async with httpx.AsyncClient(base_url=cp.base_url, timeout=30.0, limits=limits) as client:
        gate = asyncio.Semaphore(16)

        async def one(node_id: str, token: str) -> None:
            async with gate:
                body, auth = heartbeat(node_id), bearer(token)
                response = await client.post("/v1/nodes/heartbeat", json=body, headers=auth)
                assert response.status_code == 200, response.text

        await asyncio.gather(*(one(n, t) for n, t in zip(node_ids, tokens, strict=True)))


def test_a_thousand_nodes_beating_to_the_leader_count_at_the_follower(
    start_replica: Any, pg_url: str, tokens: TokenSet
) -> None:
    a = start_replica("a", HEARTBEAT_INTERVAL_S)
    wait_for(lambda: is_leader(a, tokens), "a to lead")
    admin = bearer(tokens.admin)
    assert httpx.post(a.base_url + "/v1/regions", json=REGION, headers=admin).status_code == 201
    node_ids = [f"n{i:04d}" for i in range(NUM_NODES)]
    node_tokens = mint_all(pg_url, node_ids)
    b = start_replica("b", HEARTBEAT_INTERVAL_S)
    wait_for(lambda: status(b, tokens)["num_nodes"] == 0, "b up")
    asyncio.run(beat_all(a, node_ids, node_tokens))
    wait_for(lambda: status(a, tokens)["num_healthy_nodes"] == NUM_NODES, "all healthy at a")
    wait_for(lambda: status(b, tokens)["num_healthy_nodes"] == NUM_NODES, "all healthy at b")
