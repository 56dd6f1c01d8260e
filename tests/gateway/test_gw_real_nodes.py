"""Through the gateway to real node agents (`python -m node_agent`, the real SmolLM2) in two
regions, with the simulated RTTs, using the official openai client over verified HTTPS."""

from __future__ import annotations

import signal
import ssl
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from gw_fleet import Fleet, free_port, wait_until
from suite_env import child_env

from engine.model_store import DEFAULT_MODEL

REPO_ROOT = Path(__file__).resolve().parents[2]
MAX_LOAD_S = 120.0  # both models loading at once on a small CPU machine

pytestmark = pytest.mark.slow


def start_real_node(
    fleet: Fleet, region: str, log_dir: Path, *extra_args: str, serving_token: str | None = None
) -> subprocess.Popen[bytes]:
    """A real node agent for `region`, registered behind the simulated RTT, logging to
    `log_dir`/node-REGION.log; with `serving_token`, it serves only callers that present it."""
    base_env = child_env()
    node_id = f"{region}-n1"
    env = base_env | {"MERIDIAN_NODE_TOKEN": fleet.mint_node_token(node_id, region)}
    if serving_token is not None:
        env["MERIDIAN_SERVING_TOKEN"] = serving_token
    port = free_port()
    fleet.add_region_in_front_of(region, port)
    args = [
        sys.executable,
        "-m",
        "node_agent",
        "--model",
        DEFAULT_MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--region",
        region,
        "--node-id",
        node_id,
        "--control-plane",
        fleet.cp_url,
        "--heartbeat-interval",
        "0.5",
        "--num-kv-blocks",
        "256",
        "--max-model-len",
        "1024",
        *extra_args,
    ]
    with (log_dir / f"node-{region}.log").open("wb") as log:
        return subprocess.Popen(args, cwd=REPO_ROOT, env=env, stdout=log, stderr=log)


def stop_nodes(nodes: list[subprocess.Popen[bytes]]) -> None:
    for node in nodes:
        if node.poll() is None:
            node.send_signal(signal.SIGINT)
    for node in nodes:
        try:
            node.wait(timeout=15)
        except subprocess.TimeoutExpired:
            node.kill()
            node.wait(timeout=5)


@contextmanager
def fp32_regions(
    tmp_path: Path, cert: tuple[Path, Path], serving_token: str
) -> Iterator[tuple[Fleet, dict[str, subprocess.Popen[bytes]]]]:
    """A control plane and a real node agent in fp32 (a resumed greedy stream goes on exactly
    as the unbroken one only in fp32: docs/gateway.md) in us-east and in eu-west, each serving
    only the callers that present `serving_token` (resumed ids are a gateway's field)."""
    fleet = Fleet(tmp_path, cert, heartbeat_interval_s=0.5)
    processes: dict[str, subprocess.Popen[bytes]] = {}
    try:
        fleet.start_control_plane()
        for region in ("us-east", "eu-west"):
            processes[region] = start_real_node(
                fleet, region, tmp_path, "--dtype", "float32", serving_token=serving_token
            )
        yield fleet, processes
    finally:
        stop_nodes(list(processes.values()))
        fleet.close()


@pytest.fixture
def real_fleet(
    tmp_path: Path, server_cert: tuple[Path, Path], smollm2_gguf: Path
) -> Iterator[Fleet]:
    # Real nodes beat every 0.5 s; give them 1.5 s of slack while they compute.
    fleet = Fleet(tmp_path, server_cert, heartbeat_interval_s=0.5)
    nodes: list[subprocess.Popen[bytes]] = []
    try:
        fleet.start_control_plane()
        for region in ("us-east", "eu-west"):
            nodes.append(start_real_node(fleet, region, tmp_path))
        yield fleet
    finally:
        stop_nodes(nodes)
        fleet.close()


def test_openai_client_through_the_gateway_to_real_nodes(
    real_fleet: Fleet, client_ssl: ssl.SSLContext, tmp_path: Path
) -> None:
    gateway = real_fleet.start_gateway()
    _, secret = real_fleet.create_key()
    real_fleet.wait_for_gateway(gateway, num_regions=2, timeout_s=MAX_LOAD_S)
    with openai.OpenAI(
        base_url=gateway.base_url + "/v1",
        api_key=secret,
        max_retries=0,
        http_client=httpx.Client(verify=client_ssl, timeout=60.0),
    ) as client:
        raw = client.chat.completions.with_raw_response.create(
            model=DEFAULT_MODEL,
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=8,
            extra_headers={"X-Request-Id": "real-node-1"},
        )
        completion = raw.parse()
        assert raw.headers["x-meridian-region"] == "us-east"  # the nearer one
        assert completion.choices[0].message.content
        assert completion.usage is not None and 0 < completion.usage.completion_tokens <= 8
        # Read upstream as a stream (gateway/whole.py), answered in the node's non-stream shape.
        answer = raw.http_response.json()
        assert list(answer) == ["id", "object", "created", "model", "choices", "usage"]
        assert answer["object"] == "chat.completion"
        assert list(answer["choices"][0]) == ["index", "message", "logprobs", "finish_reason"]
        assert answer["choices"][0]["message"]["role"] == "assistant"
        assert "real-node-1" in (tmp_path / "node-us-east.log").read_text()

        # The node measured its prefill: its beats carry the rate, the region's summary the
        # mean, and the gateway predicts prefill in us-east by it, not its fleet-wide default.
        router = gateway.handlers.router
        east = router.regions["us-east"]
        wait_until(lambda: east.summary.queue.prefill_tokens_per_s is not None, 5.0)
        reported = east.summary.queue.prefill_tokens_per_s
        assert reported is not None and reported > 0.0
        assert router.load_of(east).prefill_tokens_per_s == reported
        assert all(m.queue.prefill_tokens_per_s == reported for m in east.summary.models)
        assert router.regions["eu-west"].summary.queue.prefill_tokens_per_s is None  # no work yet

        # Drain the near region: the far one's real node streams the next answer.
        real_fleet.set_region_state("us-east", "draining")

        wait_until(lambda: router.regions["us-east"].summary.state == "draining", 2.0)
        with client.chat.completions.with_streaming_response.create(
            model=DEFAULT_MODEL,
            messages=[{"role": "user", "content": "Count to three."}],
            max_tokens=6,
            stream=True,
        ) as response:
            assert response.headers["x-meridian-region"] == "eu-west"
            chunks = list(response.parse())
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text and all(c.usage is None for c in chunks)
