"""A real node agent whose engine core process is stopped (SIGSTOP: alive, silent, its sockets
open) behind the gateway: a non-streamed request is answered by the other region within seconds,
named in `x-meridian-region`, rather than after the 60 s stream idle timeout (the node's role
chunk, sent without the engine, no longer counts as the first byte), and the control plane
lists the node unhealthy (its heartbeats say its engine is not alive)."""

from __future__ import annotations

import contextlib
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from gw_fleet import Fleet, wait_until
from test_gw_real_nodes import MAX_LOAD_S, start_real_node, stop_nodes

from engine.model_store import DEFAULT_MODEL
from gateway.calls import REGION_HEADER

pytestmark = pytest.mark.slow

IDLE_TIMEOUT_S = 60.0  # what the request waited before


@pytest.fixture
def near_real_far_fake(
    tmp_path: Path, server_cert: tuple[Path, Path], smollm2_gguf: Path
) -> Iterator[tuple[Fleet, subprocess.Popen[bytes]]]:
    """us-east: a real node agent; eu-west: a fake region serving the same model, further
    away, and saying it serves the same weights (the gateway fails over only among those)."""
    fleet = Fleet(tmp_path, server_cert, heartbeat_interval_s=0.5)
    nodes: list[subprocess.Popen[bytes]] = []
    try:
        fleet.start_control_plane()
        nodes.append(start_real_node(fleet, "us-east", tmp_path))
        far = fleet.add_region("eu-west", model=DEFAULT_MODEL)

        def real_identity() -> dict[str, object] | None:
            assert fleet.admin is not None
            node = fleet.admin.get("/v1/nodes/us-east-n1")  # 404 until its first beat
            beat = node.json()["last_heartbeat"] if node.status_code == 200 else None
            return None if beat is None else beat["model_identity"]

        wait_until(real_identity, MAX_LOAD_S, "the real node's first beat")
        far.model_identity = real_identity()
        yield fleet, nodes[0]
    finally:
        stop_nodes(nodes)
        fleet.close()


def engine_core_of(node: subprocess.Popen[bytes]) -> psutil.Process:
    [core] = [
        p for p in psutil.Process(node.pid).children() if "spawn_main" in " ".join(p.cmdline())
    ]
    return core


def test_a_node_with_a_stopped_engine_is_passed_over_within_seconds(
    near_real_far_fake: tuple[Fleet, subprocess.Popen[bytes]], client_ssl: ssl.SSLContext
) -> None:
    fleet, node = near_real_far_fake
    gateway = fleet.start_gateway(stream_idle_timeout_s=IDLE_TIMEOUT_S)
    _, secret = fleet.create_key()
    fleet.wait_for_gateway(gateway, num_regions=2, timeout_s=MAX_LOAD_S)
    router = gateway.handlers.router
    wait_until(
        lambda: (
            router.serving_key_of("eu-west", DEFAULT_MODEL)
            == router.serving_key_of("us-east", DEFAULT_MODEL)
            is not None
        ),
        5.0,
        "both regions' weights to be the same",
    )
    wait_until(lambda: len(gateway.handlers.keys) > 0, 5.0, "the key snapshot")
    body = {
        "model": DEFAULT_MODEL,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 4,
    }
    headers = {"Authorization": f"Bearer {secret}"}
    core = engine_core_of(node)
    with httpx.Client(
        base_url=gateway.base_url, verify=client_ssl, headers=headers, timeout=2 * IDLE_TIMEOUT_S
    ) as http:
        served = http.post("/v1/chat/completions", json=body)
        assert served.status_code == 200 and served.headers[REGION_HEADER] == "us-east"
        core.suspend()
        try:
            started_s = time.monotonic()
            answer = http.post("/v1/chat/completions", json=body)
            took_s = time.monotonic() - started_s
            assert answer.status_code == 200, answer.text
            assert answer.headers[REGION_HEADER] == "eu-west"
            assert answer.json()["served_by"] == "eu-west"
            assert took_s < IDLE_TIMEOUT_S / 3
            wait_until(
                lambda: router.regions["us-east"].summary.unhealthy_nodes == ("us-east-n1",),
                15.0,
                "the control plane to list the node unhealthy",
            )
            print(f"\nanswered by eu-west {took_s:.2f} s after the request")
        finally:
            with contextlib.suppress(psutil.Error):
                core.resume()
